// AVX-512 instantiation of the causal folds (causal_fold.h), built with
// AVX-512 flags and called only when the CPU has it and hd % 16 == 0.
#include <immintrin.h>
#include <stdint.h>

#include "ops/causal_fold.h"

namespace ls {
namespace ops {
namespace internal {
namespace {

struct Avx512 {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
};

}  // namespace

void causal_rows_avx512(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S,
                        int hd) {
  causal_fold::fold<Avx512, true>(A, lda, M, ldm, out, ldo, S, hd);
}

void causal_cols_avx512(const float* A, int64_t lda, const float* M, int64_t ldm, float* out, int64_t ldo, int S,
                        int hd) {
  causal_fold::fold<Avx512, false>(A, lda, M, ldm, out, ldo, S, hd);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
