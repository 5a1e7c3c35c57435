// MoE routing and combine as CUDA kernels, the bits of ops::route_topk,
// ops::moe_combine and ops::moe_combine_backward. One thread per token
// (routing: K argmax scans in ascending expert index, ties to the lowest;
// combine: the fold over slots) or per (token, slot) pair (backward: the gate
// gradient's fold over the feature j).
#pragma once

#include <cstdint>

#include "contract.h"

namespace ls::kernels {

__global__ void route_topk(const float* g_all, int64_t N, int E, int K, int* sel) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float* g = g_all + n * E;
  uint64_t taken[4] = {0, 0, 0, 0};  // E <= 256
  for (int s = 0; s < K; ++s) {
    int best = -1;
    float best_g = 0.0f;
    for (int e = 0; e < E; ++e) {
      const bool take = !((taken[e >> 6] >> (e & 63)) & 1) && (best < 0 || g[e] > best_g);
      best = take ? e : best;
      best_g = take ? g[e] : best_g;
    }
    taken[best >> 6] |= 1ull << (best & 63);
    sel[n * K + s] = best;
  }
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

}  // namespace ls::kernels
