// The avx512-bf16 path's micro-kernel (built with -mavx512bf16): vdpbf16ps
// runs the contract's bf16 fold itself. Per fp32 lane it adds two bf16
// products, the one in the lane's high half first and then the low half's,
// each add rounded once (an fma of an exact product) with denormal inputs
// read as zeros and tiny results flushed (Intel's SDM; probed on this
// project's AMD EPYC machines, ../shared/FACTS.md). So the packing puts
// E's k and k + 2 in one lane (k high, k + 2 low) and O's k + 1 and k + 3 in
// another: one instruction is two of the contract's steps of E, or of O, in
// its order. Where a step's result is tiny, the hardware rounds onto the
// subnormal grid before flushing and the contract rounds to 24 bits first;
// they can differ only where a product has bits below 2^-149, which
// gemm_bf16.cc rules out for each tile from its packed operands' smallest
// exponents before it runs this kernel on it (gemm_bf16.h).
#include <immintrin.h>

#include <cstdint>

#include "ops/flush_to_zero.h"
#include "ops/gemm_bf16.h"

namespace ls::ops::internal {

namespace {

// A subnormal lane (vfpclassps category 0x20) becomes the zero of its sign.
inline __m512 flush16(__m512 x) {
  const __mmask16 tiny = _mm512_fpclass_ps_mask(x, 0x20);
  return _mm512_mask_and_ps(x, tiny, x, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN)));
}

inline __m512 canonical16(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(x, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

inline __m512bh pairs(__m512i x) { return (__m512bh)x; }

}  // namespace

// Four of the panel's eight rows (from row `r0`) x 32 lanes: per 32-k block
// (16 pair rows: E's 8, then O's 8) E and O each fold from +0 in registers,
// both at once (each accumulator still takes its own steps in order), and
// C = flush(flush(E + O) + C) stays in registers across the blocks: 24
// accumulators, so nothing is stored until the end.
template <int R0>
inline void fold_rows4(int64_t kp, const uint32_t* a, const uint32_t* b, float* c, int64_t ldc, bool load) {
  constexpr int MR = 8, NR = 32, R = 4;
  __m512 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      acc[r][h] = load ? flush16(_mm512_loadu_ps(c + (R0 + r) * ldc + 16 * h)) : _mm512_setzero_ps();
  for (int64_t pr0 = 0; pr0 < kp; pr0 += 16) {
    __m512 e[R][2], o[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) e[r][0] = e[r][1] = o[r][0] = o[r][1] = _mm512_setzero_ps();
    const uint32_t* ae = a + pr0 * MR + R0;
    const uint32_t* be = b + pr0 * NR;
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512bh e0 = pairs(_mm512_loadu_si512(be + p * NR)), e1 = pairs(_mm512_loadu_si512(be + p * NR + 16));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh x = pairs(_mm512_set1_epi32((int)ae[p * MR + r]));
        e[r][0] = _mm512_dpbf16_ps(e[r][0], x, e0);
        e[r][1] = _mm512_dpbf16_ps(e[r][1], x, e1);
      }
      const __m512bh o0 = pairs(_mm512_loadu_si512(be + (p + 8) * NR)),
                     o1 = pairs(_mm512_loadu_si512(be + (p + 8) * NR + 16));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh x = pairs(_mm512_set1_epi32((int)ae[(p + 8) * MR + r]));
        o[r][0] = _mm512_dpbf16_ps(o[r][0], x, o0);
        o[r][1] = _mm512_dpbf16_ps(o[r][1], x, o1);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm512_add_ps(_mm512_add_ps(e[r][h], o[r][h]), acc[r][h]);  // flushed: FTZ
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(c + (R0 + r) * ldc + 16 * h, canonical16(acc[r][h]));
}

// 8 x 32, as two passes of four rows over the same packed B (from L1).
void gemm_bf16_ukernel_avx512bf16_8x32(int64_t kp, const void* av, const void* bv, float* c, int64_t ldc, bool load) {
  const uint32_t* a = static_cast<const uint32_t*>(av);
  const uint32_t* b = static_cast<const uint32_t*>(bv);
  const FlushToZero ftz;  // the adds' flush (flush_to_zero.h): their operands are never subnormal (vdpbf16ps
                          // flushes its results, C is flushed as loaded), so a tiny sum is exact and FTZ
                          // makes it the zero of its sign, the contract's flushed add; vdpbf16ps ignores MXCSR
  fold_rows4<0>(kp, a, b, c, ldc, load);
  fold_rows4<4>(kp, a, b, c, ldc, load);
}

}  // namespace ls::ops::internal
