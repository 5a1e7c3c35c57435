// The weight-gradient kernel, written once over a vector type: linear.cc
// instantiates it with AVX2 (8 lanes), weight_grad_avx512.cc with AVX-512 (16
// lanes). Include only from those two files.
//
// One R x (JV * lanes) tile of dW = X^T dY runs its whole reduction over the
// token index k: per leaf the sequential fma fold over the leaf's rows from
// +0 stays in registers, and the canonical leaf tree (contract.h's LeafTree:
// equal-sized subtrees merge as leaves arrive, the stack folds right to left
// at the end) keeps its partial sums in a small stack of tiles in L1. A
// row of X gives R broadcasts, a row of the column block's dY panel JV
// vectors. The panel (column_tiles packs it once for all the block's tiles)
// keeps the tiles' loads sequential: dY rows read in place at power-of-two
// strides fall into a few L1 sets and evict each other.
#pragma once

#include <stdint.h>

#include "contract.h"

namespace ls {
namespace ops {
namespace leaf_grad {

// Scratch floats column_tiles needs for `leaves` leaves over `rows` rows of
// X and dY: the tiles' leaf stack, then the dY panel (16 floats of slack to
// align it).
template <class V, int R, int JV>
int64_t scratch_floats(int64_t leaves, int64_t rows) {
  return ((int64_t)LeafTree::levels_for(leaves) * R + rows) * JV * V::kLanes + 16;
}

// Lanes of vector v (0 .. JV-1) that fall inside `cols` columns.
template <class V>
int lanes_in(int cols, int v) {
  const int n = cols - v * V::kLanes;
  return n < 0 ? 0 : (n > V::kLanes ? V::kLanes : n);
}

// dW[i0 + r][j0 + c] for r < rows (<= R), c < cols (<= JV * lanes). The
// block's dY row k is at y + (k - leaf_off[0]) * ldy: JV * lanes readable
// floats, zero past cols. kFull: rows == R and cols == JV * lanes.
template <class V, int R, int JV, bool kFull>
void tile(const float* X, int64_t ldx, const float* y0, int64_t ldy, const int64_t* leaf_off, int64_t leaves,
          int i0, int rows, int j0, int cols, float* dW, int64_t ldw, float* stack) {
  using T = typename V::T;
  constexpr int L = V::kLanes, W = R * JV * L;  // floats per stack entry
  int lanes[JV];
  for (int v = 0; v < JV; ++v) lanes[v] = lanes_in<V>(cols, v);
  int depth = 0;  // stack entries
  T acc[R][JV];
  for (int64_t l = 0; l < leaves; ++l) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < JV; ++v) acc[r][v] = V::zero();
    for (int64_t k = leaf_off[l]; k < leaf_off[l + 1]; ++k) {  // the leaf's rows, ascending
      const float* x = X + k * ldx + i0;
      const float* y = y0 + (k - leaf_off[0]) * ldy;
      T b[JV];
      for (int v = 0; v < JV; ++v) b[v] = V::load(y + v * L);
      for (int r = 0; r < R; ++r) {
        if (!kFull && r >= rows) break;
        const T a = V::set1(x[r]);
        for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(a, b[v], acc[r][v]);
      }
    }
    // Push the leaf, merging left + right as LeafTree::push does.
    const int merges = LeafTree::merges_on_push(l);
    for (int d = depth - 1; d >= depth - merges; --d) {
      const float* left = stack + (int64_t)d * W;
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < JV; ++v) acc[r][v] = V::add(V::load(left + (r * JV + v) * L), acc[r][v]);
    }
    depth -= merges;
    float* top = stack + (int64_t)depth * W;
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < JV; ++v) V::store(top + (r * JV + v) * L, acc[r][v]);
    ++depth;
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
// the rows i0 .. i1-1, a block of R rows at a time. They read the block's dY
// columns from a packed panel when it fits in L1 (every tile after the first
// then hits L1), or when rows of dY 1 KiB apart would share a few L1 sets;
// else in place (a panel that spills to L2 only adds traffic). scratch:
// scratch_floats(leaves, rows).
template <class V, int R, int JV>
void column_tiles(const float* X, int64_t ldx, const float* dY, int64_t ldy, const int64_t* leaf_off,
                  int64_t leaves, int i0, int i1, int j0, int j1, float* dW, int64_t ldw, float* scratch) {
  constexpr int L = V::kLanes, C = JV * L;
  const int cols = j1 - j0;
  float* stack = scratch;
  // 64-byte aligned: a vector load that splits a cache line costs two.
  float* panel = scratch + (int64_t)LeafTree::levels_for(leaves) * R * C;
  panel += (64 - (reinterpret_cast<uintptr_t>(panel) & 63)) / 4 & 15;
  const int64_t k0 = leaf_off[0], k1 = leaf_off[leaves];
  constexpr int64_t kL1PanelFloats = 32 * 1024 / 4;
  const float* y0 = panel;  // the block's dY row k0, and the stride of its rows
  int64_t ly = C;
  if (cols == C && (k1 - k0) * C > kL1PanelFloats && ldy % 256 != 0) {
    y0 = dY + k0 * ldy + j0;
    ly = ldy;
  } else {
    for (int64_t k = k0; k < k1; ++k) {
      const float* y = dY + k * ldy + j0;
      float* p = panel + (k - k0) * C;
      for (int v = 0; v < JV; ++v)
        V::store(p + v * L, cols == C ? V::load(y + v * L) : V::load_first(y + v * L, lanes_in<V>(cols, v)));
    }
  }
  for (int i = i0; i < i1; i += R) {
    const int rows = i1 - i < R ? i1 - i : R;
    if (rows == R && cols == C)
      tile<V, R, JV, true>(X, ldx, y0, ly, leaf_off, leaves, i, rows, j0, cols, dW, ldw, stack);
    else
      tile<V, R, JV, false>(X, ldx, y0, ly, leaf_off, leaves, i, rows, j0, cols, dW, ldw, stack);
  }
}

}  // namespace leaf_grad
}  // namespace ops
}  // namespace ls
