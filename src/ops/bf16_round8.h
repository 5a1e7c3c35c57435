// Eight fp32 values rounded to bf16 in an AVX2 register (ls::to_bf16: round
// to nearest even, a NaN kept quiet), shared by the bf16 stores
// (bf16_store.cc) and the bf16 GEMM's packing (gemm_bf16.cc). Both are core
// sources, built with the project's AVX2 flags alone; inline, so each loop
// that rounds keeps it in registers.
#pragma once

#include <immintrin.h>

namespace ls::ops {

// Eight lanes of fp32 bits -> their bf16 in the low 16 bits of each lane, the high 16 zero.
inline __m256i bf16_round8(__m256i u) {
  const __m256i lsb = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), quiet = _mm256_set1_epi32(0x40);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), _mm256_and_si256(_mm256_srli_epi32(u, 16), lsb)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
  return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet), nan);
}

// The same bf16 in each lane's high 16 bits, the low 16 zero: the fp32 bits
// of the rounded value (ls::from_bf16(ls::to_bf16(x))).
inline __m256i bf16_round8_high(__m256i u) { return _mm256_slli_epi32(bf16_round8(u), 16); }

}  // namespace ls::ops
