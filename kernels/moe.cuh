// MoE routing, dispatch and combine as CUDA kernels, the bits of
// ops::route_topk, ops::copy_rows, ops::moe_combine, ops::moe_combine_backward,
// ops::slot_sum and the router gradient's terms. One thread per token
// (routing: K argmax scans in ascending expert index, ties to the lowest;
// combine: the fold over slots), per (token, slot) pair (backward: the gate
// gradient's fold over the feature j), or per element (row copies, slot sums:
// the fold over slots of one feature).
#pragma once

#include <cstdint>

#include "contract.h"

namespace ls::kernels {

// Token n's top-k: contract.h's scan (ties to the lowest expert).
__global__ void route_topk(const float* g_all, int64_t N, int E, int K, int* sel) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n < N) ls::topk_lowest_index(g_all + n * E, E, K, sel + n * K);
}

// hout[n][j] = residual[n][j] + ((fold over s of fma(gate_s, y_s[j], .) from +0) + shared[n][j]).
__global__ void moe_combine(const float* g, int E, const int* sel, int K, const int64_t* row_of, const float* ye_rows,
                            const float* shared, const float* residual, float* hout, int64_t N, int D) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  for (int j = 0; j < D; ++j) {
    float out = 0.0f;
    for (int s = 0; s < K; ++s)
      out = ls::fma(g[n * E + sel[n * K + s]], ye_rows[row_of[n * K + s] * D + j], out);
    if (shared) out = out + shared[n * D + j];
    hout[n * D + j] = residual[n * D + j] + out;
  }
}

__global__ void moe_combine_backward(const float* dh, const float* g, int E, const int* sel, int K,
                                     const int64_t* row_of, const float* ye_rows, float* dg, float* dye, int64_t N,
                                     int D) {
  const int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (q >= N * K) return;
  const int64_t n = q / K;
  const float *dhn = dh + n * D, *y = ye_rows + row_of[q] * D;
  float dgate = 0.0f;
  for (int j = 0; j < D; ++j) dgate = ls::fma(dhn[j], y[j], dgate);
  const int e = sel[q];
  const float gate = g[n * E + e];
  dg[n * E + e] = dgate;
  float* out = dye + row_of[q] * D;
  for (int j = 0; j < D; ++j) out[j] = gate * dhn[j];
}

// Dispatch and collect: row dst_row[t] of dst = row src_row[t] of src (null:
// row t), rows of `width` floats. One thread per element of the n rows.
__global__ void copy_rows(const float* src, const int64_t* src_row, float* dst, const int64_t* dst_row, int64_t n,
                          int64_t width) {
  const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= n * width) return;
  const int64_t t = x / width, i = x % width;
  dst[(dst_row ? dst_row[t] : t) * width + i] = src[(src_row ? src_row[t] : t) * width + i];
}

// out[n][j] = fold over slots s of (out + rows[row_of[n*K + s]][j]) from +0.
// One thread per (token, feature).
__global__ void slot_sum(const float* rows, const int64_t* row_of, int K, int64_t N, int D, float* out) {
  const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= N * D) return;
  const int64_t n = x / D, j = x % D;
  float acc = 0.0f;
  for (int s = 0; s < K; ++s) acc = acc + rows[row_of[n * K + s] * D + j];
  out[x] = acc;
}

// x[n][e] = x[n][e] + vec[e] for e < cols (rows of ld floats).
__global__ void add_row_vector(float* x, int64_t N, int64_t ld, int cols, const float* vec) {
  const int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (q >= N * cols) return;
  const int64_t n = q / cols, e = q % cols;
  x[n * ld + e] = x[n * ld + e] + vec[e];
}

// dz[n][e] = dz[n][e] + ((two_zw * lse[n]) / Ng) * g[n][e].
__global__ void z_loss_grad(const float* g, const float* lse, int64_t N, int E, float two_zw, float Ng, float* dz) {
  const int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (q >= N * E) return;
  const float zc = (two_zw * lse[q / E]) / Ng;
  dz[q] = dz[q] + zc * g[q];
}

}  // namespace ls::kernels
