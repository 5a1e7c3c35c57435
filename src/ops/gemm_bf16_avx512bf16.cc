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
// they can differ only for operands below 2^-62 in magnitude, which
// gemm_bf16.cc checks for before it picks this path (gemm_bf16.h).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "ops/gemm_bf16.h"

namespace ls::ops::internal {

namespace {

inline __m512 flush16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(0x1p-126f), _CMP_LT_OQ);
  return _mm512_mask_and_ps(x, tiny, x, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN)));
}

inline __m512 canonical16(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(x, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

inline __m512bh pairs(__m512i x) { return (__m512bh)x; }

}  // namespace

// One of E or O over a 32-k block: 8 pair rows from `a` and `b`, MR x 32
// lanes from +0.
template <int MR>
inline void fold_half(const uint32_t* a, const uint32_t* b, __m512 (&acc)[MR][2]) {
  constexpr int NR = 32;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    const __m512bh b0 = pairs(_mm512_loadu_si512(b + p * NR)), b1 = pairs(_mm512_loadu_si512(b + p * NR + 16));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = pairs(_mm512_set1_epi32((int)a[p * MR + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
}

// 8 x 32: per 32-k block (16 pair rows: E's 8, then O's 8) E in 16 zmm from
// +0, kept aside, then O; C = flush(flush(E + O) + C), C kept in a buffer.
void gemm_bf16_ukernel_avx512bf16_8x32(int64_t kp, const void* av, const void* bv, float* c, int64_t ldc, bool load) {
  constexpr int MR = 8, NR = 32;
  const uint32_t* a = static_cast<const uint32_t*>(av);
  const uint32_t* b = static_cast<const uint32_t*>(bv);
  alignas(64) float cbuf[MR][NR], ebuf[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h)
      _mm512_store_ps(&cbuf[r][16 * h], load ? flush16(_mm512_loadu_ps(c + r * ldc + 16 * h)) : _mm512_setzero_ps());
  for (int64_t pr0 = 0; pr0 < kp; pr0 += 16) {
    __m512 acc[MR][2];
    fold_half<MR>(a + pr0 * MR, b + pr0 * NR, acc);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) _mm512_store_ps(&ebuf[r][16 * h], acc[r][h]);
    fold_half<MR>(a + (pr0 + 8) * MR, b + (pr0 + 8) * NR, acc);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m512 s = flush16(_mm512_add_ps(_mm512_load_ps(&ebuf[r][16 * h]), acc[r][h]));
        _mm512_store_ps(&cbuf[r][16 * h], flush16(_mm512_add_ps(s, _mm512_load_ps(&cbuf[r][16 * h]))));
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(c + r * ldc + 16 * h, canonical16(_mm512_load_ps(&cbuf[r][16 * h])));
}

// gemm_bf16.cc's check before it picks this path (called only where it may).
bool has_tiny(const ConstMatBf16& m, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t e = m.p[r * m.rs + c * m.cs] >> 7 & 0xff;  // biased exponent; 0: zero or (flushed) subnormal
      if (e != 0 && e < 127 - 62) return true;
    }
  return false;
}
bool has_tiny(const ConstMat& m, int64_t rows, int64_t cols) {
  // Walk the operand along whichever of its strides is 1, eight values at a time.
  const bool by_rows = m.cs == 1 || m.rs != 1;
  const int64_t outer = by_rows ? rows : cols, inner = by_rows ? cols : rows;
  const int64_t os = by_rows ? m.rs : m.cs, is = by_rows ? m.cs : m.rs;
  const __m256 limit = _mm256_set1_ps(0x1p-61f), abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t o = 0; o < outer; ++o) {
    const float* p = m.p + o * os;
    int64_t i = 0;
    if (is == 1) {
      __m256 any = _mm256_setzero_ps();
      for (; i + 8 <= inner; i += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(p + i), abs_mask);
        any = _mm256_or_ps(any, _mm256_and_ps(_mm256_cmp_ps(a, limit, _CMP_LT_OQ),
                                              _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_OQ)));
      }
      if (_mm256_movemask_ps(any)) return true;
    }
    for (; i < inner; ++i) {
      const float a = std::fabs(p[i * is]);
      if (a != 0.0f && a < 0x1p-61f) return true;
    }
  }
  return false;
}

}  // namespace ls::ops::internal
