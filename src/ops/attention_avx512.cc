// AVX-512 instantiation of the attention kernels (attention_kernels.h), built with
// AVX-512 flags and called only when the CPU has it.
#include <immintrin.h>
#include <stdint.h>

#include "ops/attention_kernels.h"
#include "ops/vec_avx512.h"

namespace ls {
namespace ops {
namespace internal {

// hd % 16 == 0. The query-range kernels of attention_kernels.h.
void causal_rows_avx512(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo,
                        int hd) {
  attention_kernels::fold<Avx512, true>(A, Q, t_off, M, ldm, out, ldo, hd, false);
}

void causal_cols_avx512(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo,
                        int hd, bool accumulate, int u_begin, int u_end) {
  attention_kernels::fold<Avx512, false>(A, Q, t_off, M, ldm, out, ldo, hd, accumulate, u_begin, u_end);
}

void causal_scores_avx512(const float* X, int64_t ldx, const float* Y, int64_t ldy, int Q, int t_off, int hd,
                          float* out, float* xt) {
  attention_kernels::scores<Avx512>(X, ldx, Y, ldy, Q, t_off, hd, out, xt);
}

void softmax_blocks_avx512(float* s, int Q, int t_off, float scale) {
  attention_kernels::softmax_blocks<Avx512>(s, Q, t_off, scale);
}

void softmax_backward_blocks_avx512(const float* P, float* dp, int Q, int t_off, float scale) {
  attention_kernels::softmax_backward_blocks<Avx512>(P, dp, Q, t_off, scale);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
