// RMSNorm as a CUDA kernel: y = (x * r) * w, r = 1 / sqrt(sum_i x_i^2 / D + eps),
// the bits of ops::rmsnorm. Reduces over the feature i: one thread per token
// runs that token's fma fold in ascending i (threads side by side run
// independent folds; no shuffle or atomic touches a sum).
#pragma once

#include <cstdint>

#include "contract.h"

namespace ls::kernels {

__global__ void rmsnorm_forward(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float* xn = x + n * D;
  float ss = 0.0f;
  for (int i = 0; i < D; ++i) ss = ls::fma(xn[i], xn[i], ss);
  const float rn = 1.0f / ls::sqrt(ss / (float)D + eps);
  r[n] = rn;
  for (int i = 0; i < D; ++i) y[n * D + i] = (xn[i] * rn) * w[i];
}

// dx = r (dy w - (x r) c), c = (fold over i of (dy_i w_i)(x_i r)) / D; written
// to dh, or added (dh = dh + dx) with accumulate. The bits of
// ops::rmsnorm_backward. Reduces over the feature i: one thread per token.
__global__ void rmsnorm_backward(const float* x, const float* w, const float* r, const float* dy, float* dh,
                                 int64_t N, int D, bool accumulate) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float *xn = x + n * D, *dyn = dy + n * D;
  const float rn = r[n];
  float dot = 0.0f;
  for (int i = 0; i < D; ++i) dot = ls::fma(dyn[i] * w[i], xn[i] * rn, dot);
  const float c = dot / (float)D;
  float* dhn = dh + n * D;
  for (int i = 0; i < D; ++i) {
    const float dx = rn * (dyn[i] * w[i] - (xn[i] * rn) * c);
    dhn[i] = accumulate ? dhn[i] + dx : dx;
  }
}

// dw_i = canonical tree over leaves of leaf_tokens tokens of (fma fold over
// the leaf's tokens n of dy[n][i] (x[n][i] r[n])). The bits of
// ops::rmsnorm_weight_grad. Reduces over the token index: one thread per
// feature i runs its own tree.
__global__ void rmsnorm_weight_grad(const float* x, const float* r, const float* dy, int64_t N, int D,
                                    int64_t leaf_tokens, float* dw) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= D) return;
  float stack[64];
  ls::LeafTree tree(stack, 1);
  for (int64_t l = 0; l < N / leaf_tokens; ++l) {
    float a = 0.0f;
    for (int64_t n = l * leaf_tokens; n < (l + 1) * leaf_tokens; ++n)
      a = ls::fma(dy[n * D + i], x[n * D + i] * r[n], a);
    *tree.next_leaf() = a;
    tree.push();
  }
  dw[i] = *tree.finish();
}

}  // namespace ls::kernels
