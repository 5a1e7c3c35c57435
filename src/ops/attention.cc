#include "ops/attention.h"

#include <immintrin.h>

#include <algorithm>

#include "contract.h"
#include "ops/causal_fold.h"
#include "ops/gemm.h"
#include "ops/ops.h"
#include "ops/vec_avx2.h"

namespace ls::ops {
namespace internal {
// attention_avx512.cc: the same folds with 16-lane vectors (hd % 16 == 0).
void causal_rows_avx512(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S,
                        int hd);
void causal_cols_avx512(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S,
                        int hd);
}  // namespace internal
namespace {

// out[t][:] = fold over u = 0..t, ascending, from +0, of A[t][u] * M[u][:].
// Reduces over the key position u <= t (the causal prefix of row t).
void causal_rows_scalar(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S,
                        int hd) {
  for (int t = 0; t < S; ++t)
    for (int j = 0; j < hd; ++j) {
      float acc = 0.0f;
      for (int u = 0; u <= t; ++u) acc = ls::fma(A[(int64_t)t * lda + u], M[(int64_t)u * ldm + j], acc);
      out[(int64_t)t * ldo + j] = acc;
    }
}

// out[u][:] = fold over t = u..S-1, ascending, from +0, of A[t][u] * M[t][:].
// Reduces over the query position t >= u (the causal suffix of column u).
void causal_cols_scalar(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S,
                        int hd) {
  for (int u = 0; u < S; ++u)
    for (int j = 0; j < hd; ++j) {
      float acc = 0.0f;
      for (int t = u; t < S; ++t) acc = ls::fma(A[(int64_t)t * lda + u], M[(int64_t)t * ldm + j], acc);
      out[(int64_t)u * ldo + j] = acc;
    }
}

template <bool kRows>
void causal(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S, int hd) {
  const GemmPath path = gemm_path();
  if (path == GemmPath::kAvx512 && hd % 16 == 0) {
    if (kRows) return internal::causal_rows_avx512(A, lda, M, ldm, out, ldo, S, hd);
    return internal::causal_cols_avx512(A, lda, M, ldm, out, ldo, S, hd);
  }
  if (path == GemmPath::kScalar) {  // the plain loops, as on a CPU without AVX2
    if (kRows) return causal_rows_scalar(A, lda, M, ldm, out, ldo, S, hd);
    return causal_cols_scalar(A, lda, M, ldm, out, ldo, S, hd);
  }
  if (hd % 8 == 0) return causal_fold::fold<internal::Avx2, kRows>(A, lda, M, ldm, out, ldo, S, hd);
  if (kRows) return causal_rows_scalar(A, lda, M, ldm, out, ldo, S, hd);
  causal_cols_scalar(A, lda, M, ldm, out, ldo, S, hd);
}

}  // namespace

void attention_forward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                       float* P, float* o, int64_t ldo, AttentionScratch& sc) {
  sc.t0.resize((size_t)S * S);
  float* s = sc.t0.data();
  // s[t][u] = fold over j of q[t][j] k[u][j] (the GEMM's sequential fold from +0);
  // the entries u > t are computed and never read.
  gemm(S, S, hd, ConstMat{q, ld, 1}, ConstMat{k, 1, ld}, s, S, false, 1);
  for (int t = 0; t < S; ++t) {
    float* st = s + (int64_t)t * S;
    for (int u = 0; u <= t; ++u) st[u] = st[u] * scale;
  }
  softmax_rows(s, S, P, S, S, 1, 1, nullptr);  // row t over u <= t
  causal<true>(P, S, v, ld, o, ldo, S, hd);
}

void attention_backward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                        const float* P, const float* dO, int64_t ldo, float* dq, float* dk, float* dv, int64_t ldd,
                        AttentionScratch& sc) {
  sc.t0.resize((size_t)S * S);
  sc.t1.resize((size_t)S * S);
  float* dp = sc.t0.data();
  float* dS = sc.t1.data();
  // dp[t][u] = fold over j of dO[t][j] v[u][j]; entries u > t are never read.
  gemm(S, S, hd, ConstMat{dO, ldo, 1}, ConstMat{v, 1, ld}, dp, S, false, 1);
  softmax_backward_rows(P, S, dp, S, dS, S, S, 1, 1);  // row t over u <= t
  for (int t = 0; t < S; ++t) {
    float* dst = dS + (int64_t)t * S;
    for (int u = 0; u <= t; ++u) dst[u] = dst[u] * scale;
  }
  causal<true>(dS, S, k, ld, dq, ldd, S, hd);    // dq over u <= t
  causal<false>(dS, S, q, ld, dk, ldd, S, hd);   // dk over t >= u
  causal<false>(P, S, dO, ldo, dv, ldd, S, hd);  // dv over t >= u
}

}  // namespace ls::ops
