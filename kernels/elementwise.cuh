// Element- and row-wise kernels of the step, each the bits of its CPU
// engine op: SwiGLU and its backward (elementwise), row softmax (reduces over
// the entry index: one thread per row, a sequential sum), the sum of squares
// of the gradient norm (reduces over the parameter index: one thread per
// kParamBlock block, its fma fold; then the canonical tree over blocks), and
// AdamW (elementwise).
#pragma once

#include <cstdint>

#include "contract.h"

namespace ls::kernels {

// s = csigmoid(u), act = (u * s) * v.
__global__ void swiglu_forward(const float* u, const float* v, float* s, float* act, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float si = ls::csigmoid(u[i]);
  s[i] = si;
  act[i] = (u[i] * si) * v[i];
}

// dv = dact * (u * s), du = (dact * v) * (s * (1 + u * (1 - s))).
__global__ void swiglu_backward(const float* u, const float* v, const float* s, const float* dact, float* du,
                                float* dv, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  dv[i] = dact[i] * (u[i] * s[i]);
  du[i] = (dact[i] * v[i]) * (s[i] * (1.0f + u[i] * (1.0f - s[i])));
}

// act = (u * s) * v from the kept gate s: ops::swiglu_product.
__global__ void swiglu_product(const float* u, const float* s, const float* v, float* act, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  act[i] = (u[i] * s[i]) * v[i];
}

// out = a + b (residual adds, LeafFold merges): ops::add.
__global__ void add(const float* a, const float* b, float* out, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = a[i] + b[i];
}

// p = value: ops::fill.
__global__ void fill(float* p, int64_t n, float value) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  p[i] = value;
}

// Row r of `rows` rows of n entries (stride ld): p = softmax(z) as
// ops::softmax (max by scan, cexp(z - m), sequential sum, divide); lse[r] =
// m + clog(sum) when lse is not null.
__global__ void softmax_rows(const float* z, float* p, int64_t ld, int rows, int n, float* lse) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float* zr = z + (int64_t)r * ld;
  float* pr = p + (int64_t)r * ld;
  float m = zr[0];
  for (int e = 1; e < n; ++e)
    if (zr[e] > m) m = zr[e];
  float sum = 0.0f;
  for (int e = 0; e < n; ++e) {
    pr[e] = ls::cexp(zr[e] - m);
    sum = sum + pr[e];
  }
  for (int e = 0; e < n; ++e) pr[e] = pr[e] / sum;
  if (lse) lse[r] = m + ls::clog(sum);
}

// dz = p (dp - dot), dot = fold over the entry e of dp_e p_e: ops::softmax_backward_rows' bits.
__global__ void softmax_backward_rows(const float* p, const float* dp, float* dz, int64_t ld, int rows, int n) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float *pr = p + (int64_t)r * ld, *dpr = dp + (int64_t)r * ld;
  float dot = 0.0f;
  for (int e = 0; e < n; ++e) dot = ls::fma(dpr[e], pr[e], dot);
  float* dzr = dz + (int64_t)r * ld;
  for (int e = 0; e < n; ++e) dzr[e] = pr[e] * (dpr[e] - dot);
}

// block_sums[b] = sumsq_block of parameter block b (kParamBlock elements, the last may be short).
__global__ void sumsq_blocks(const float* v, int64_t n, float* block_sums) {
  const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t blocks = (n + kParamBlock - 1) / kParamBlock;
  if (b >= blocks) return;
  const int64_t len = n - b * kParamBlock < kParamBlock ? n - b * kParamBlock : kParamBlock;
  block_sums[b] = ls::sumsq_block(v + b * kParamBlock, len);
}

// out[0] = the canonical tree over the block sums (one thread: the tree is
// sequential by definition and tiny).
__global__ void tree_over_blocks(const float* block_sums, int64_t blocks, float* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  out[0] = ls::tree_sum(block_sums, blocks);
}

// One AdamW step on n elements (optim/adamw.cc): with clip, g = g * clip_scale
// (stored back); m, v, bias corrections bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
// computed by the caller as the engine does; decoupled weight decay when decay.
struct AdamWArgs {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, bc1, bc2, eps, weight_decay, lr, clip_scale;
  bool clip, decay;
};
__global__ void adamw_step(float* w, float* g, float* m, float* v, int64_t n, AdamWArgs a) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float gi = g[i];
  if (a.clip) {
    gi = gi * a.clip_scale;
    g[i] = gi;
  }
  m[i] = a.beta1 * m[i] + a.one_minus_beta1 * gi;
  v[i] = a.beta2 * v[i] + a.one_minus_beta2 * (gi * gi);
  const float mhat = m[i] / a.bc1, vhat = v[i] / a.bc2;
  float upd = mhat / (ls::sqrt(vhat) + a.eps);
  if (a.decay) upd = upd + a.weight_decay * w[i];
  w[i] = w[i] - a.lr * upd;
}

}  // namespace ls::kernels
