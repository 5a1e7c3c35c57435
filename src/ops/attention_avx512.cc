// AVX-512 instantiation of the attention kernels (attention_kernels.h), built with
// AVX-512 flags and called only when the CPU has it.
#include <immintrin.h>
#include <stdint.h>

#include "ops/attention_kernels.h"
#include "ops/vec_avx512.h"

namespace ls {
namespace ops {
namespace internal {

// hd % 16 == 0.
void causal_rows_avx512(const float* A, int S, const float* M, int64_t ldm, float* out, int64_t ldo, int hd) {
  attention_kernels::fold<Avx512, true>(A, S, M, ldm, out, ldo, hd);
}

void causal_cols_avx512(const float* A, int S, const float* M, int64_t ldm, float* out, int64_t ldo, int hd) {
  attention_kernels::fold<Avx512, false>(A, S, M, ldm, out, ldo, hd);
}

void causal_scores_avx512(const float* X, int64_t ldx, const float* Y, int64_t ldy, int S, int hd, float* out,
                          float* xt) {
  attention_kernels::scores<Avx512>(X, ldx, Y, ldy, S, hd, out, xt);
}

void softmax_blocks_avx512(float* s, int S, float scale) {
  attention_kernels::softmax_blocks<Avx512>(s, S, scale);
}

void softmax_backward_blocks_avx512(const float* P, float* dp, int S, float scale) {
  attention_kernels::softmax_backward_blocks<Avx512>(P, dp, S, scale);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
