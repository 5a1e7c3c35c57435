// Weight gradients over tokens as the contract's leaf tree:
// dW[i][j] = canonical tree over leaves l of (fma fold over the rows n of
// leaf l, in order, from +0, of X[n][i] * dY[n][j]); an empty leaf is +0.
// The bits of ops::weight_grad. Reduces over the token index n. One thread
// per output element runs that element's whole tree (the CPU engine's
// tile-with-a-stack design at tile size 1x1); threads side by side run
// independent trees, and no atomic or shuffle touches a sum.
#pragma once

#include <cstdint>

#include "contract.h"
#include "gemm_bf16.cuh"

namespace ls::kernels {

constexpr int kMaxTreeLevels = 64;  // LeafTree::levels_for(any int64 leaf count) fits

// One output's leaf tree: dW[i][j] = canonical tree over leaves of each
// leaf's fold from +0 over its rows, the fp32 fma fold (ascending rows) or,
// at bf16, kernels::bf16_dot_rounded (its 32-row blocks start at the
// leaf's first row). Reduces over the token index n.
__device__ inline float leaf_tree_of(const float* X, int64_t ldx, const float* dY, int64_t ldy, int64_t i, int64_t j,
                                     const int64_t* leaf_off, int64_t leaves, bool bf16) {
  float stack[kMaxTreeLevels];
  ls::LeafTree tree(stack, 1);
  for (int64_t l = 0; l < leaves; ++l) {
    const int64_t n0 = leaf_off[l], n1 = leaf_off[l + 1];
    float acc = 0.0f;
    if (bf16) acc = bf16_dot_rounded(X + n0 * ldx + i, ldx, dY + n0 * ldy + j, ldy, n1 - n0, 0.0f);
    else
      for (int64_t n = n0; n < n1; ++n) acc = ls::fma(X[n * ldx + i], dY[n * ldy + j], acc);
    *tree.next_leaf() = acc;
    tree.push();
  }
  return *tree.finish();
}

// Grid: (ceil(out / blockDim.x), ceil(in / blockDim.y)); thread (j, i).
__global__ void weight_grad_leaves(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                                   const int64_t* leaf_off, int64_t leaves, float* dW) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t i = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
  if (i < in && j < out) dW[i * out + j] = leaf_tree_of(X, ldx, dY, ldy, i, j, leaf_off, leaves, false);
}

// numerics.precision=bf16: the same, each leaf the bf16 fold. Grid and threads as weight_grad_leaves.
__global__ void weight_grad_leaves_bf16(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                                        const int64_t* leaf_off, int64_t leaves, float* dW) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t i = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
  if (i < in && j < out) dW[i * out + j] = leaf_tree_of(X, ldx, dY, ldy, i, j, leaf_off, leaves, true);
}

}  // namespace ls::kernels
