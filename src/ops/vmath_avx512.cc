// Batch contract math, AVX-512 path (16 lanes; built with -mavx512f and
// picked at run time). Same lane-by-lane replay of contract_math.h as the
// AVX2 path in vmath.cc, with mask registers for the branches and masked
// loads/stores for the tail. Lanes needing cexp's subnormal-result branch
// are redone by the scalar function.
//
// contract.h is not included here: its inline functions compiled with
// AVX-512 flags could be the copy the linker keeps for the whole program.
// The scalar fallbacks are out-of-line functions of vmath.cc instead.
#include <immintrin.h>
#include <stdint.h>

// GCC 12's avx512fintrin.h trips -Wuninitialized on its own placeholder
// operands (_mm512_undefined_epi32) when inlined; a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace ls {
namespace ops {
namespace internal {
// vmath.cc: ls::cexp and ls::csigmoid, compiled without AVX-512.
float cexp_scalar(float x);
float csigmoid_scalar(float x);

namespace {

inline __m512 c16(float v) { return _mm512_set1_ps(v); }
inline __m512 bits16(uint32_t u) { return _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)u)); }
const float kRoundMagic = 12582912.0f;  // 0x1.8p23, as cmath_detail::kRoundMagic
inline __m512 neg16(__m512 v) {  // exact negation, as the scalar unary minus
  __m512i u = _mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(u);
}

// cmath_detail::exp_parts, lane by lane: e^x = 2^n * (a + b).
struct Parts16 {
  __m512i n;
  __m512 a, b;
};
inline Parts16 exp_parts16(__m512 x) {
  const __m512 magic = c16(kRoundMagic);
  const __m512 ln2lo = c16(-1.9046542121259336e-09f);
  __m512 kf = _mm512_fmadd_ps(x, c16(1.44269502162933349609375f), magic);
  __m512i n = _mm512_sub_epi32(_mm512_castps_si512(kf), _mm512_castps_si512(magic));
  __m512 nf = _mm512_sub_ps(kf, magic);
  __m512 r1 = _mm512_fnmadd_ps(nf, c16(0.693147182464599609375f), x);
  __m512 ph = _mm512_mul_ps(nf, ln2lo);
  __m512 pl = _mm512_fmsub_ps(nf, ln2lo, ph);
  __m512 r = _mm512_sub_ps(r1, ph);
  __m512 bv = _mm512_sub_ps(r, r1);
  __m512 r_lo = _mm512_sub_ps(_mm512_add_ps(_mm512_sub_ps(r1, _mm512_sub_ps(r, bv)),
                                            _mm512_sub_ps(neg16(ph), bv)),
                              pl);
  __m512 z = _mm512_mul_ps(r, r);
  __m512 p = c16(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, c16(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, c16(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, c16(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, c16(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, c16(5.0000001201e-1f));
  __m512 a = _mm512_add_ps(c16(1.0f), r);
  __m512 a_lo = _mm512_add_ps(_mm512_sub_ps(c16(1.0f), a), r);
  __m512 b = _mm512_add_ps(a_lo, _mm512_fmadd_ps(z, p, _mm512_fmadd_ps(r, r_lo, r_lo)));
  return {n, a, b};
}

// 2^n from bits for -126 <= n <= 127 (other lanes: garbage, masked away).
inline __m512 pow2_normal16(__m512i n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}

// The normal-result test of cexp: n > -126 || (n == -126 && w >= 1).
inline __mmask16 normal16(__m512i n, __m512 w) {
  __mmask16 gt = _mm512_cmpgt_epi32_mask(n, _mm512_set1_epi32(-126));
  __mmask16 eq = _mm512_cmpeq_epi32_mask(n, _mm512_set1_epi32(-126));
  return gt | (eq & _mm512_cmp_ps_mask(w, c16(1.0f), _CMP_GE_OQ));
}

// ls::cexp on 16 lanes; *slow gets the lanes that need the subnormal-result
// branch and must be redone by the scalar function.
inline __m512 exp16(__m512 x, __mmask16* slow) {
  __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __mmask16 over = _mm512_cmp_ps_mask(x, c16(88.72283172607421875f), _CMP_GT_OQ);
  __mmask16 under = _mm512_cmp_ps_mask(x, c16(-103.97207641601562f), _CMP_LT_OQ);
  Parts16 e = exp_parts16(x);
  __m512 w = _mm512_add_ps(e.a, e.b);
  __mmask16 normal = normal16(e.n, w);
  // n == 128: (w * 2^127) * 2, as 2^128 is not a float.
  __mmask16 n128 = _mm512_cmpeq_epi32_mask(e.n, _mm512_set1_epi32(128));
  __m512 y = _mm512_mul_ps(w, pow2_normal16(_mm512_min_epi32(e.n, _mm512_set1_epi32(127))));
  y = _mm512_mask_mul_ps(y, n128, y, c16(2.0f));
  *slow = (__mmask16) ~(is_nan | over | under | normal);
  y = _mm512_mask_mov_ps(y, under, _mm512_setzero_ps());
  y = _mm512_mask_mov_ps(y, over, bits16(0x7f800000u));
  return _mm512_mask_mov_ps(y, is_nan, bits16(0x7fc00000u));
}

// ls::csigmoid on 16 lanes; *slow as for exp16 (|x| in about [87.34, 103.97]).
inline __m512 sigmoid16(__m512 x, __mmask16* slow) {
  __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
  __m512 m = _mm512_mask_mov_ps(x, pos, neg16(x));  // -|x|
  // Both branches take exp_parts(m): exp_dd for m >= -80, cexp below.
  Parts16 e = exp_parts16(m);
  __m512 w = _mm512_add_ps(e.a, e.b);
  __m512 w_lo = _mm512_add_ps(_mm512_sub_ps(e.a, w), e.b);
  __m512 s = pow2_normal16(e.n);  // n >= -116 where exp_dd is used
  __m512 hi = _mm512_mul_ps(w, s);
  __m512 lo = _mm512_mul_ps(w_lo, s);
  // m < -80: cexp(m), which is hi when normal (n <= 0: no n == 128 case).
  __mmask16 far = _mm512_cmp_ps_mask(m, c16(-80.0f), _CMP_LT_OQ);
  __mmask16 under = _mm512_cmp_ps_mask(m, c16(-103.97207641601562f), _CMP_LT_OQ);
  *slow = far & (__mmask16) ~(under | normal16(e.n, w) | is_nan);
  __m512 ev = _mm512_mask_mov_ps(hi, under, _mm512_setzero_ps());
  __m512 ev_lo = _mm512_mask_mov_ps(lo, far, _mm512_setzero_ps());
  __m512 num = _mm512_mask_mov_ps(ev, pos, c16(1.0f));
  __m512 num_lo = _mm512_mask_mov_ps(ev_lo, pos, _mm512_setzero_ps());
  __m512 d = _mm512_add_ps(c16(1.0f), ev);
  __m512 d_lo = _mm512_add_ps(_mm512_add_ps(_mm512_sub_ps(c16(1.0f), d), ev), ev_lo);
  __m512 q = _mm512_div_ps(num, d);
  __m512 res = _mm512_fnmadd_ps(q, d, num);
  __m512 corr = _mm512_div_ps(_mm512_add_ps(res, _mm512_sub_ps(num_lo, _mm512_mul_ps(q, d_lo))), d);
  __m512 y = _mm512_add_ps(q, corr);
  return _mm512_mask_mov_ps(y, is_nan, bits16(0x7fc00000u));
}

// Runs kernel K over n elements (input v = pre(x[i])), 16 at a time, the
// tail with masked loads/stores; flagged lanes get scalar(v).
template <typename Pre, typename Kernel, typename Scalar>
inline void run16(const float* x, float* y, int64_t n, Pre pre, Kernel kernel, Scalar scalar) {
  alignas(64) float v_lanes[16];
  auto block = [&](const float* in, float* out, __mmask16 live) {
    __m512 v = pre(_mm512_maskz_loadu_ps(live, in));
    __mmask16 slow;
    __m512 r = kernel(v, &slow);
    _mm512_mask_storeu_ps(out, live, r);
    slow &= live;
    if (slow) {  // rare: redo those lanes exactly, from v (in may be out)
      _mm512_store_ps(v_lanes, v);
      for (int j = 0; j < 16; ++j)
        if (slow >> j & 1) out[j] = scalar(v_lanes[j]);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) block(x + i, y + i, (__mmask16)0xffff);
  if (i < n) block(x + i, y + i, (__mmask16)((1u << (n - i)) - 1u));
}

inline __m512 identity16(__m512 v) { return v; }

}  // namespace

void exp_n_avx512(const float* x, float* y, int64_t n) {
  run16(x, y, n, identity16, exp16, cexp_scalar);
}

void sigmoid_n_avx512(const float* x, float* y, int64_t n) {
  run16(x, y, n, identity16, sigmoid16, csigmoid_scalar);
}

void exp_shifted_n_avx512(const float* x, float m, float* y, int64_t n) {
  const __m512 mv = _mm512_set1_ps(m);
  run16(x, y, n, [mv](__m512 v) { return _mm512_sub_ps(v, mv); }, exp16, cexp_scalar);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
