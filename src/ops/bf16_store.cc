#include "ops/bf16_store.h"

#include <immintrin.h>

#include "contract.h"

namespace ls::ops {

namespace {

// Eight lanes of fp32 bits -> their bf16 (ls::to_bf16) in the low 16 bits of each lane.
inline __m256i round8(__m256i u) {
  const __m256i lsb = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), quiet = _mm256_set1_epi32(0x40);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), _mm256_and_si256(_mm256_srli_epi32(u, 16), lsb)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
  return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet), nan);
}

}  // namespace

void to_bf16_n(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = round8(_mm256_loadu_si256((const __m256i*)(x + i)));
    const __m256i hi = round8(_mm256_loadu_si256((const __m256i*)(x + i + 8)));
    // packus interleaves 128-bit lanes: put them back in order.
    _mm256_storeu_si256((__m256i*)(y + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8));
  }
  for (; i < n; ++i) y[i] = ls::to_bf16(x[i]);
}

void from_bf16_n(const uint16_t* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x + i)));
    _mm256_storeu_si256((__m256i*)(y + i), _mm256_slli_epi32(w, 16));
  }
  for (; i < n; ++i) y[i] = ls::from_bf16(x[i]);
}

void round_bf16_n(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i r = round8(_mm256_loadu_si256((const __m256i*)(x + i)));
    _mm256_storeu_si256((__m256i*)(x + i), _mm256_slli_epi32(r, 16));
  }
  for (; i < n; ++i) x[i] = ls::from_bf16(ls::to_bf16(x[i]));
}

}  // namespace ls::ops
