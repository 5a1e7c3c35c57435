// AVX-512 twins of attention.cc's register-blocked causal folds (built with
// AVX-512 flags, called only when the CPU has it and hd % 16 == 0). Same
// folds, same order: lanes run over the feature j, eight accumulators in
// flight (R rows x JV vectors of 16 features).
#include <immintrin.h>
#include <stdint.h>

namespace ls {
namespace ops {
namespace internal {
namespace {

inline int min_int(int a, int b) { return a < b ? a : b; }

// out[t][:] = fold over u = 0..t, ascending, from +0, of A[t][u] * M[u][:].
template <int R, int JV>
void rows_block(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int t0, int rows,
                int j0) {
  __m512 acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int u = 0; u <= t0; ++u) {  // every row of the block takes the term
    __m512 m[JV];
    for (int v = 0; v < JV; ++v) m[v] = _mm512_loadu_ps(M + (int64_t)u * ldm + j0 + 16 * v);
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const __m512 a = _mm512_set1_ps(A[(int64_t)(t0 + r) * lda + u]);
      for (int v = 0; v < JV; ++v) acc[r][v] = _mm512_fmadd_ps(a, m[v], acc[r][v]);
    }
  }
  for (int u = t0 + 1; u < t0 + rows; ++u) {  // only rows t >= u
    __m512 m[JV];
    for (int v = 0; v < JV; ++v) m[v] = _mm512_loadu_ps(M + (int64_t)u * ldm + j0 + 16 * v);
    for (int r = u - t0; r < rows; ++r) {
      const __m512 a = _mm512_set1_ps(A[(int64_t)(t0 + r) * lda + u]);
      for (int v = 0; v < JV; ++v) acc[r][v] = _mm512_fmadd_ps(a, m[v], acc[r][v]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < JV; ++v) _mm512_storeu_ps(out + (int64_t)(t0 + r) * ldo + j0 + 16 * v, acc[r][v]);
}

// out[u][:] = fold over t = u..S-1, ascending, from +0, of A[t][u] * M[t][:].
template <int R, int JV>
void cols_block(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S, int u0,
                int rows, int j0) {
  __m512 acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int t = u0; t < u0 + rows; ++t) {  // only outputs u <= t
    __m512 m[JV];
    for (int v = 0; v < JV; ++v) m[v] = _mm512_loadu_ps(M + (int64_t)t * ldm + j0 + 16 * v);
    for (int r = 0; r <= t - u0; ++r) {
      const __m512 a = _mm512_set1_ps(A[(int64_t)t * lda + u0 + r]);
      for (int v = 0; v < JV; ++v) acc[r][v] = _mm512_fmadd_ps(a, m[v], acc[r][v]);
    }
  }
  for (int t = u0 + rows; t < S; ++t) {  // every output of the block takes the term
    __m512 m[JV];
    for (int v = 0; v < JV; ++v) m[v] = _mm512_loadu_ps(M + (int64_t)t * ldm + j0 + 16 * v);
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const __m512 a = _mm512_set1_ps(A[(int64_t)t * lda + u0 + r]);
      for (int v = 0; v < JV; ++v) acc[r][v] = _mm512_fmadd_ps(a, m[v], acc[r][v]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < JV; ++v) _mm512_storeu_ps(out + (int64_t)(u0 + r) * ldo + j0 + 16 * v, acc[r][v]);
}

template <bool kRows, int JV>
void blocked(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S, int hd) {
  constexpr int R = 8 / JV;
  for (int j0 = 0; j0 < hd; j0 += 16 * JV)
    for (int i0 = 0; i0 < S; i0 += R) {
      const int rows = min_int(R, S - i0);
      if (kRows)
        rows_block<R, JV>(A, lda, M, ldm, out, ldo, i0, rows, j0);
      else
        cols_block<R, JV>(A, lda, M, ldm, out, ldo, S, i0, rows, j0);
    }
}

template <bool kRows>
void dispatch(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S, int hd) {
  if (hd % 64 == 0) return blocked<kRows, 4>(A, lda, M, ldm, out, ldo, S, hd);
  if (hd % 32 == 0) return blocked<kRows, 2>(A, lda, M, ldm, out, ldo, S, hd);
  blocked<kRows, 1>(A, lda, M, ldm, out, ldo, S, hd);
}

}  // namespace

void causal_rows_avx512(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S,
                        int hd) {
  dispatch<true>(A, lda, M, ldm, out, ldo, S, hd);
}

void causal_cols_avx512(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S,
                        int hd) {
  dispatch<false>(A, lda, M, ldm, out, ldo, S, hd);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
