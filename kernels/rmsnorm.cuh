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

}  // namespace ls::kernels
