// AVX2 vectors (8 float lanes) for the register-blocked folds written once
// over a vector type (attention_kernels.h, leaf_grad.h). The core sources are built
// with AVX2 and FMA.
#pragma once

#include <immintrin.h>

namespace ls::ops::internal {

struct Avx2 {
  using T = __m256;
  static constexpr int kLanes = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  // The first n lanes from p, zeros in the others (0 <= n <= 8).
  static T load_first(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  // Lane masks: ordered compares (false when either side is NaN), and a
  // select that takes b where the mask is set, else a.
  using M = __m256;
  static M le(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  static M gt(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static M both(M a, M b) { return _mm256_and_ps(a, b); }
  static T select(M m, T a, T b) { return _mm256_blendv_ps(a, b, m); }
  static T iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, T v, int n) { _mm256_maskstore_ps(p, mask(n), v); }

 private:
  static __m256i mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
};

}  // namespace ls::ops::internal
