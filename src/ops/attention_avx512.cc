// AVX-512 instantiation of the causal folds (causal_fold.h), built with
// AVX-512 flags and called only when the CPU has it and hd % 16 == 0.
#include <immintrin.h>
#include <stdint.h>

#include "ops/causal_fold.h"
#include "ops/vec_avx512.h"

namespace ls {
namespace ops {
namespace internal {

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
