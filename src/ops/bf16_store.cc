#include "ops/bf16_store.h"

#include <immintrin.h>

#include "contract.h"
#include "ops/bf16_round8.h"

namespace ls::ops {

void to_bf16_n(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = bf16_round8(_mm256_loadu_si256((const __m256i*)(x + i)));
    const __m256i hi = bf16_round8(_mm256_loadu_si256((const __m256i*)(x + i + 8)));
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
    _mm256_storeu_si256((__m256i*)(x + i), bf16_round8_high(_mm256_loadu_si256((const __m256i*)(x + i))));
  }
  for (; i < n; ++i) x[i] = ls::from_bf16(ls::to_bf16(x[i]));
}

}  // namespace ls::ops
