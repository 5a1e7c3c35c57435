// The register-blocked causal folds of attention, written once over a vector
// type: attention.cc instantiates them with AVX2 (8 lanes), attention_avx512.cc
// with AVX-512 (16 lanes). Include only from those two files; each is built
// with the instruction set its vector type needs.
//
// Lanes run over the feature j; R output rows x JV vectors (8 accumulators)
// stay in registers for the whole fold, and each M row loaded serves all R
// outputs. Every fold keeps its order: ascending, from +0.
#pragma once

#include <stdint.h>

namespace ls {
namespace ops {
namespace causal_fold {

// out[t][:] = fold over u = 0..t, ascending, from +0, of A[t][u] * M[u][:],
// for the rows t0 .. t0+rows-1 and the features j0 .. j0 + V::kLanes*JV - 1.
template <class V, int R, int JV>
void rows_block(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int t0, int rows,
                int j0) {
  typename V::T acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v] = V::zero();
  for (int u = 0; u <= t0; ++u) {  // every row of the block takes the term
    typename V::T m[JV];
    for (int v = 0; v < JV; ++v) m[v] = V::load(M + (int64_t)u * ldm + j0 + V::kLanes * v);
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const typename V::T a = V::set1(A[(int64_t)(t0 + r) * lda + u]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(a, m[v], acc[r][v]);
    }
  }
  for (int u = t0 + 1; u < t0 + rows; ++u) {  // only rows t >= u
    typename V::T m[JV];
    for (int v = 0; v < JV; ++v) m[v] = V::load(M + (int64_t)u * ldm + j0 + V::kLanes * v);
    for (int r = u - t0; r < rows; ++r) {
      const typename V::T a = V::set1(A[(int64_t)(t0 + r) * lda + u]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(a, m[v], acc[r][v]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < JV; ++v) V::store(out + (int64_t)(t0 + r) * ldo + j0 + V::kLanes * v, acc[r][v]);
}

// out[u][:] = fold over t = u..S-1, ascending, from +0, of A[t][u] * M[t][:],
// for the rows u0 .. u0+rows-1.
template <class V, int R, int JV>
void cols_block(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S, int u0,
                int rows, int j0) {
  typename V::T acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v] = V::zero();
  for (int t = u0; t < u0 + rows; ++t) {  // only outputs u <= t
    typename V::T m[JV];
    for (int v = 0; v < JV; ++v) m[v] = V::load(M + (int64_t)t * ldm + j0 + V::kLanes * v);
    for (int r = 0; r <= t - u0; ++r) {
      const typename V::T a = V::set1(A[(int64_t)t * lda + u0 + r]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(a, m[v], acc[r][v]);
    }
  }
  for (int t = u0 + rows; t < S; ++t) {  // every output of the block takes the term
    typename V::T m[JV];
    for (int v = 0; v < JV; ++v) m[v] = V::load(M + (int64_t)t * ldm + j0 + V::kLanes * v);
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const typename V::T a = V::set1(A[(int64_t)t * lda + u0 + r]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(a, m[v], acc[r][v]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < JV; ++v) V::store(out + (int64_t)(u0 + r) * ldo + j0 + V::kLanes * v, acc[r][v]);
}

// The whole S x hd output in blocks; hd must be a multiple of V::kLanes * JV.
template <class V, bool kRows, int JV>
void blocked(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S, int hd) {
  constexpr int R = 8 / JV;
  for (int j0 = 0; j0 < hd; j0 += V::kLanes * JV)
    for (int i0 = 0; i0 < S; i0 += R) {
      const int rows = S - i0 < R ? S - i0 : R;
      if (kRows)
        rows_block<V, R, JV>(A, lda, M, ldm, out, ldo, i0, rows, j0);
      else
        cols_block<V, R, JV>(A, lda, M, ldm, out, ldo, S, i0, rows, j0);
    }
}

// Picks the widest block the head width allows; hd % V::kLanes == 0.
template <class V, bool kRows>
void fold(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S, int hd) {
  if (hd % (4 * V::kLanes) == 0) return blocked<V, kRows, 4>(A, lda, M, ldm, out, ldo, S, hd);
  if (hd % (2 * V::kLanes) == 0) return blocked<V, kRows, 2>(A, lda, M, ldm, out, ldo, S, hd);
  blocked<V, kRows, 1>(A, lda, M, ldm, out, ldo, S, hd);
}

}  // namespace causal_fold
}  // namespace ops
}  // namespace ls
