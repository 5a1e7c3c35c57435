// The AdamW element loop with 16-lane vectors: the same IEEE operations, in
// the same order, as adamw.cc's scalar loop (no fma: contraction is off), so
// the same bits. Built with AVX-512 flags, called only when the CPU has it;
// its divisions and square roots run at twice the AVX2 rate.
#include <immintrin.h>
#include <stdint.h>

#include "optim/adamw_kernel.h"

// GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized on its own placeholder
// operands (_mm512_undefined_ps) when inlined; a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace ls {
namespace internal {

void adamw_elements_avx512(const AdamWElements& a, int64_t lo, int64_t hi) {
  const __m512 B1 = _mm512_set1_ps(a.b1), B2 = _mm512_set1_ps(a.b2), OMB1 = _mm512_set1_ps(a.omb1),
               OMB2 = _mm512_set1_ps(a.omb2), BC1 = _mm512_set1_ps(a.bc1), BC2 = _mm512_set1_ps(a.bc2),
               EPS = _mm512_set1_ps(a.eps), WD = _mm512_set1_ps(a.wd), LR = _mm512_set1_ps(a.lr),
               SCALE = _mm512_set1_ps(a.clip_scale);
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 live = hi - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (hi - i)) - 1u);
    __m512 g = _mm512_maskz_loadu_ps(live, a.g + i);
    if (a.clip) {
      g = _mm512_mul_ps(g, SCALE);
      _mm512_mask_storeu_ps(a.g + i, live, g);
    }
    const __m512 m = _mm512_add_ps(_mm512_mul_ps(B1, _mm512_maskz_loadu_ps(live, a.m + i)), _mm512_mul_ps(OMB1, g));
    const __m512 v =
        _mm512_add_ps(_mm512_mul_ps(B2, _mm512_maskz_loadu_ps(live, a.v + i)), _mm512_mul_ps(OMB2, _mm512_mul_ps(g, g)));
    _mm512_mask_storeu_ps(a.m + i, live, m);
    _mm512_mask_storeu_ps(a.v + i, live, v);
    const __m512 mhat = _mm512_div_ps(m, BC1), vhat = _mm512_div_ps(v, BC2);
    __m512 upd = _mm512_div_ps(mhat, _mm512_add_ps(_mm512_sqrt_ps(vhat), EPS));
    const __m512 w = _mm512_maskz_loadu_ps(live, a.w + i);
    if (a.decay) upd = _mm512_add_ps(upd, _mm512_mul_ps(WD, w));
    _mm512_mask_storeu_ps(a.w + i, live, _mm512_sub_ps(w, _mm512_mul_ps(LR, upd)));
  }
}

}  // namespace internal
}  // namespace ls
