// AVX512_BF16 micro-kernel of the bf16 GEMM (this file alone is built with
// -mavx512bf16; picked at run time by cpuid). vdpbf16ps is the contract's
// bf16 fold in hardware: per fp32 lane it adds the product of the high bf16
// halves (k = 2j+1), then of the low halves (k = 2j), each add rounded, with
// denormals flushed in and out (contract_bf16.h; tests/test_gemm_bf16.cc
// holds it to ls::bf16_dot lane by lane). Operands come packed as bf16 pairs
// (gemm_bf16.cc): A strip uint32[kp][MR], B panel uint32[kp][NR].
#include <immintrin.h>
#include <stdint.h>

namespace ls {
namespace ops {
namespace internal {

namespace {

// MR x 16*NV tile: MR*NV independent accumulator chains, NV B loads and MR
// broadcasts per k pair, as the fp32 AVX-512 kernel per k.
template <int MR, int NV>
void ukernel(int64_t kp, const uint32_t* a, const uint32_t* b, float* c, int64_t ldc, bool load) {
  constexpr int NR = 16 * NV;
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = load ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t j = 0; j < kp; ++j) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + j * NR + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[j * MR + r]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bv[v]);
    }
  }
  // NaNs stored canonical (the fold's rule; hardware passes payloads on).
  const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000));
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __m512 x = acc[r][v];
      _mm512_storeu_ps(c + r * ldc + 16 * v, _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), qnan));
    }
}

}  // namespace

void gemm_bf16_ukernel_dpbf16_8x32(int64_t kp, const void* a, const void* b, float* c, int64_t ldc, bool load) {
  ukernel<8, 2>(kp, static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b), c, ldc, load);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
