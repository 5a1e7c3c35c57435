// The weight-gradient kernel, written once over a vector type: ops.cc
// instantiates it with AVX2 (8 lanes), weight_grad_avx512.cc with AVX-512 (16
// lanes). Include only from those two files.
//
// One R x (JV * lanes) tile of dW = X^T dY runs its whole reduction over the
// token index k: per leaf the sequential fma fold over the leaf's rows from
// +0 stays in registers, and the canonical leaf tree (contract.h's LeafTree:
// equal-sized subtrees merge as leaves arrive, the stack folds right to left
// at the end) keeps its partial sums in a small stack of tiles in L1. No
// operand is packed: a row of X gives R broadcasts, a row of dY JV vectors.
#pragma once

#include <stdint.h>

#include "contract.h"

namespace ls {
namespace ops {
namespace leaf_grad {

// Scratch floats a tile needs for `leaves` leaves.
template <class V, int R, int JV>
int64_t stack_floats(int64_t leaves) {
  return (int64_t)LeafTree::levels_for(leaves) * R * JV * V::kLanes;
}

// dW[i0 + r][j0 + c] for r < rows (<= R), c < cols (<= JV * lanes). kFull:
// rows == R and cols == JV * lanes.
template <class V, int R, int JV, bool kFull>
void tile(const float* X, int64_t ldx, const float* dY, int64_t ldy, const int64_t* leaf_off, int64_t leaves,
          int i0, int rows, int j0, int cols, float* dW, int64_t ldw, float* stack) {
  using T = typename V::T;
  constexpr int L = V::kLanes, W = R * JV * L;  // floats per stack entry
  int lanes[JV];
  for (int v = 0; v < JV; ++v) lanes[v] = cols - v * L < 0 ? 0 : (cols - v * L > L ? L : cols - v * L);
  int64_t sizes[64];  // leaves held by each stack entry
  int depth = 0;
  T acc[R][JV];
  for (int64_t l = 0; l < leaves; ++l) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < JV; ++v) acc[r][v] = V::zero();
    for (int64_t k = leaf_off[l]; k < leaf_off[l + 1]; ++k) {  // the leaf's rows, ascending
      const float* x = X + k * ldx + i0;
      const float* y = dY + k * ldy + j0;
      T b[JV];
      for (int v = 0; v < JV; ++v) b[v] = kFull ? V::load(y + v * L) : V::load_first(y + v * L, lanes[v]);
      for (int r = 0; r < R; ++r) {
        if (!kFull && r >= rows) break;
        const T a = V::set1(x[r]);
        for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(a, b[v], acc[r][v]);
      }
    }
    // Push the leaf: merge with the top entry while their sizes are equal
    // (left + right, as LeafTree::push).
    int64_t size = 1;
    while (depth > 0 && sizes[depth - 1] == size) {
      const float* left = stack + (int64_t)(depth - 1) * W;
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < JV; ++v) acc[r][v] = V::add(V::load(left + (r * JV + v) * L), acc[r][v]);
      size *= 2;
      --depth;
    }
    float* top = stack + (int64_t)depth * W;
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < JV; ++v) V::store(top + (r * JV + v) * L, acc[r][v]);
    sizes[depth++] = size;
  }
  // Fold the stack right to left (LeafTree::finish); no leaves give +0.
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v] = depth > 0 ? V::load(stack + (int64_t)(depth - 1) * W + (r * JV + v) * L)
                                                       : V::zero();
  for (int d = depth - 2; d >= 0; --d)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < JV; ++v) acc[r][v] = V::add(V::load(stack + (int64_t)d * W + (r * JV + v) * L), acc[r][v]);
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < JV; ++v) {
      float* out = dW + (int64_t)(i0 + r) * ldw + j0 + v * L;
      if (kFull) V::store(out, acc[r][v]);
      else if (lanes[v] > 0) V::store_first(out, acc[r][v], lanes[v]);
    }
}

// The tiles of one column block (j0 .. j1-1, at most JV * lanes wide) for
// the rows i0 .. i1-1, a block of R rows at a time: the block's dY columns
// stay in L1 while the rows of X stream past.
template <class V, int R, int JV>
void column_tiles(const float* X, int64_t ldx, const float* dY, int64_t ldy, const int64_t* leaf_off,
                  int64_t leaves, int i0, int i1, int j0, int j1, float* dW, int64_t ldw, float* stack) {
  constexpr int C = JV * V::kLanes;
  const int cols = j1 - j0;
  for (int i = i0; i < i1; i += R) {
    const int rows = i1 - i < R ? i1 - i : R;
    if (rows == R && cols == C)
      tile<V, R, JV, true>(X, ldx, dY, ldy, leaf_off, leaves, i, rows, j0, cols, dW, ldw, stack);
    else
      tile<V, R, JV, false>(X, ldx, dY, ldy, leaf_off, leaves, i, rows, j0, cols, dW, ldw, stack);
  }
}

}  // namespace leaf_grad
}  // namespace ops
}  // namespace ls
