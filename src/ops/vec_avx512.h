// AVX-512 vectors (16 float lanes) for the register-blocked folds written
// once over a vector type (attention_kernels.h, leaf_grad.h). Include only from
// files built with AVX-512 (avx512_sources).
#pragma once

#include <immintrin.h>

namespace ls::ops::internal {

struct Avx512 {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  // The first n lanes from p, zeros in the others (0 <= n <= 16).
  static T load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  // Lane masks: ordered compares (false when either side is NaN), and a
  // select that takes b where the mask is set, else a.
  using M = __mmask16;
  static M le(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static M gt(T a, T b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M both(M a, M b) { return a & b; }
  static T select(M m, T a, T b) { return _mm512_mask_blend_ps(m, a, b); }
  static T iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, T v, int n) { _mm512_mask_storeu_ps(p, mask(n), v); }

 private:
  static __mmask16 mask(int n) { return (__mmask16)((1u << n) - 1u); }
};

}  // namespace ls::ops::internal
