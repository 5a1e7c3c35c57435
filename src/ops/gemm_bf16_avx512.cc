// AVX-512 micro-kernel of the bf16 GEMM's portable path (built with -mavx512f
// and picked at run time where the CPU lacks AMX): the contract's bf16 fold
// replayed on fp32 lanes, one fma per step, per 32-k block the even k and
// the odd k in two runs, then two flushed adds, so each lane equals
// ls::bf16_dot bit for bit. The operands come packed as
// flushed fp32 (gemm_bf16.cc). contract.h is not included here: its inline
// functions compiled with AVX-512 flags could be the copy the linker keeps.
#include <immintrin.h>
#include <stdint.h>

namespace ls {
namespace ops {
namespace internal {

float bf16_fold_step_out_of_line(float acc, float a, float b);  // gemm_bf16.cc

namespace {

inline __m512 abs16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}
inline __m512 sign16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

// Lanes whose fma result is at or below 2^-126 in magnitude: below, a zero
// of its sign (FTZ); exactly 2^-126, the contract's step decides (the exact
// sum may still be tiny at 24 bits). Rare in real data.
__attribute__((noinline)) __m512 fix_tiny16(__m512 f, __m512 acc, __m512 a, __m512 b) {
  const __m512 minnorm = _mm512_set1_ps(0x1p-126f);
  const __mmask16 lt = _mm512_cmp_ps_mask(abs16(f), minnorm, _CMP_LT_OQ);
  const __mmask16 eq = _mm512_cmp_ps_mask(abs16(f), minnorm, _CMP_EQ_OQ);
  f = _mm512_mask_mov_ps(f, lt, sign16(f));
  if (eq == 0) return f;
  alignas(64) float fv[16], accv[16], av[16], bv[16];
  _mm512_store_ps(fv, f);
  _mm512_store_ps(accv, acc);
  _mm512_store_ps(av, a);
  _mm512_store_ps(bv, b);
  for (int l = 0; l < 16; ++l)
    if (eq >> l & 1) fv[l] = bf16_fold_step_out_of_line(accv[l], av[l], bv[l]);
  return _mm512_load_ps(fv);
}

inline __m512 step16(__m512 acc, __m512 a, __m512 b) {
  const __m512 f = _mm512_fmadd_ps(a, b, acc);
  if (_mm512_cmp_ps_mask(abs16(f), _mm512_set1_ps(0x1p-126f), _CMP_LE_OQ) == 0) return f;
  return fix_tiny16(f, acc, a, b);
}

inline __m512 flush16(__m512 x) {
  return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(abs16(x), _mm512_set1_ps(0x1p-126f), _CMP_LT_OQ), sign16(x));
}

inline __m512 canonical16(__m512 x) {
  return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                            _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

constexpr int kBlock = 32;  // ls::kBf16FoldBlock

// One accumulator run of a 32-k block: k = k0, k0 + 2, ... from +0.
template <int MR, int NV>
inline void fold_half(const float* a, const float* b, int64_t k0, __m512 (&acc)[MR][NV]) {
  constexpr int NR = 16 * NV;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = k0; k < (k0 & ~int64_t(kBlock - 1)) + kBlock; k += 2) {
    const float* ak = a + k * MR;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + k * NR + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 ar = _mm512_set1_ps(ak[r]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = step16(acc[r][v], ar, bv[v]);
    }
  }
}

// MR x 16*NV tile; A strip float[2kp][MR], B panel float[2kp][16*NV]. Per
// 32-k block: the even k from +0 into the accumulators, stashed as E; the odd
// k from +0 (O); then C = flush(flush(E + O) + C), C in a buffer across blocks.
template <int MR, int NV>
void ukernel(int64_t kp, const float* a, const float* b, float* c, int64_t ldc, bool load) {
  constexpr int NR = 16 * NV;
  alignas(64) float cbuf[MR][NR], ebuf[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      _mm512_store_ps(&cbuf[r][16 * v], load ? flush16(_mm512_loadu_ps(c + r * ldc + 16 * v)) : _mm512_setzero_ps());
  for (int64_t k0 = 0; k0 < 2 * kp; k0 += kBlock) {
    __m512 acc[MR][NV];
    fold_half<MR, NV>(a, b, k0, acc);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm512_store_ps(&ebuf[r][16 * v], acc[r][v]);
    fold_half<MR, NV>(a, b, k0 + 1, acc);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __m512 s = flush16(_mm512_add_ps(_mm512_load_ps(&ebuf[r][16 * v]), acc[r][v]));
        _mm512_store_ps(&cbuf[r][16 * v], flush16(_mm512_add_ps(s, _mm512_load_ps(&cbuf[r][16 * v]))));
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, canonical16(_mm512_load_ps(&cbuf[r][16 * v])));
}

}  // namespace

void gemm_bf16_ukernel_avx512_8x32(int64_t kp, const void* a, const void* b, float* c, int64_t ldc, bool load) {
  ukernel<8, 2>(kp, static_cast<const float*>(a), static_cast<const float*>(b), c, ldc, load);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
