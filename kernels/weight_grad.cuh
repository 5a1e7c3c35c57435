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

// Grid: (ceil(out / blockDim.x), ceil(in / blockDim.y)); thread (j, i).
__global__ void weight_grad_leaves(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                                   const int64_t* leaf_off, int64_t leaves, float* dW) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t i = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
  if (i >= in || j >= out) return;
  float stack[kMaxTreeLevels];
  ls::LeafTree tree(stack, 1);
  for (int64_t l = 0; l < leaves; ++l) {
    float acc = 0.0f;
    for (int64_t n = leaf_off[l]; n < leaf_off[l + 1]; ++n) acc = ls::fma(X[n * ldx + i], dY[n * ldy + j], acc);
    *tree.next_leaf() = acc;
    tree.push();
  }
  dW[i * out + j] = *tree.finish();
}

// numerics.precision=bf16: the same leaf tree, each leaf's sum the bf16 fold
// (kernels::bf16_dot_rounded) over its rows from +0, so the fold's 32-row
// blocks start at each leaf's first row. Reduces over the token index n.
// Grid and threads as weight_grad_leaves.
__global__ void weight_grad_leaves_bf16(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                                        const int64_t* leaf_off, int64_t leaves, float* dW) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t i = (int64_t)blockIdx.y * blockDim.y + threadIdx.y;
  if (i >= in || j >= out) return;
  float stack[kMaxTreeLevels];
  ls::LeafTree tree(stack, 1);
  for (int64_t l = 0; l < leaves; ++l) {
    const int64_t n0 = leaf_off[l];
    *tree.next_leaf() = bf16_dot_rounded(X + n0 * ldx + i, ldx, dY + n0 * ldy + j, ldy, leaf_off[l + 1] - n0, 0.0f);
    tree.push();
  }
  dW[i * out + j] = *tree.finish();
}

}  // namespace ls::kernels
