// Batch contract math: dispatcher, scalar path and AVX2 path (8 lanes).
//
// Each lane replays ls::cexp / ls::csigmoid (contract_math.h) operation for
// operation: the same constants, the same fma calls (fma(-a,b,c) as fnmadd,
// fma(a,b,-c) as fmsub: negation is exact, so the values are identical),
// the same order. Branches are computed on all lanes and blended. The one
// path not replayed is cexp's subnormal-result branch (x in about
// [-103.97, -87.34]); lanes that need it are flagged and recomputed with
// the scalar function, so they too get its bits.
#include "ops/vmath.h"
#include "common/numerics_level.h"
#include "ops/local.h"

#include <immintrin.h>
#include <string.h>

#include <atomic>

#include "numerics/contract.h"

namespace ls {
namespace ops {
namespace internal {
// vmath_avx512.cc (built with AVX-512 flags; called only when the CPU has it).
void exp_n_avx512(const float* x, float* y, int64_t n);
void sigmoid_n_avx512(const float* x, float* y, int64_t n);
void exp_shifted_n_avx512(const float* x, float m, float* y, int64_t n);

// The scalar fallbacks of the AVX-512 path, out of line so that file needs
// no contract.h inlines compiled with AVX-512 flags.
float cexp_scalar(float x) { return ls::cexp(x); }
float csigmoid_scalar(float x) { return ls::csigmoid(x); }
}  // namespace internal

namespace {

// ------------------------------------------------------------ dispatch ----
std::atomic<int> g_forced{static_cast<int>(GemmPath::kAuto)};

GemmPath effective_path() {
  GemmPath p = static_cast<GemmPath>(g_forced.load(std::memory_order_relaxed));
  if (p != GemmPath::kAuto && gemm_path_supported(p)) return p;
  return best_cpu_path();
}

// ---------------------------------------------------------------- AVX2 ----
inline __m256 c8(float v) { return _mm256_set1_ps(v); }
inline __m256 neg8(__m256 v) {  // exact negation, as the scalar unary minus
  return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)));
}
inline __m256 sel8(__m256 mask, __m256 yes, __m256 no) { return _mm256_blendv_ps(no, yes, mask); }

// cmath_detail::exp_parts, lane by lane: e^x = 2^n * (a + b).
struct Parts8 {
  __m256i n;
  __m256 a, b;
};
inline Parts8 exp_parts8(__m256 x) {
  const __m256 magic = c8(cmath_detail::kRoundMagic);
  const __m256 ln2lo = c8(-1.9046542121259336e-09f);
  __m256 kf = _mm256_fmadd_ps(x, c8(1.44269502162933349609375f), magic);
  __m256i n = _mm256_sub_epi32(_mm256_castps_si256(kf), _mm256_castps_si256(magic));
  __m256 nf = _mm256_sub_ps(kf, magic);
  __m256 r1 = _mm256_fnmadd_ps(nf, c8(0.693147182464599609375f), x);
  __m256 ph = _mm256_mul_ps(nf, ln2lo);
  __m256 pl = _mm256_fmsub_ps(nf, ln2lo, ph);
  __m256 r = _mm256_sub_ps(r1, ph);
  __m256 bv = _mm256_sub_ps(r, r1);
  __m256 r_lo = _mm256_sub_ps(_mm256_add_ps(_mm256_sub_ps(r1, _mm256_sub_ps(r, bv)),
                                            _mm256_sub_ps(neg8(ph), bv)),
                              pl);
  __m256 z = _mm256_mul_ps(r, r);
  __m256 p = c8(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, c8(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, c8(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, c8(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, c8(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, c8(5.0000001201e-1f));
  __m256 a = _mm256_add_ps(c8(1.0f), r);
  __m256 a_lo = _mm256_add_ps(_mm256_sub_ps(c8(1.0f), a), r);
  __m256 b = _mm256_add_ps(a_lo, _mm256_fmadd_ps(z, p, _mm256_fmadd_ps(r, r_lo, r_lo)));
  return {n, a, b};
}

// 2^n from bits for -126 <= n <= 127 (other lanes: garbage, blended away).
inline __m256 pow2_normal8(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

// The normal-result test of cexp: n > -126 || (n == -126 && w >= 1).
inline __m256 normal8(__m256i n, __m256 w) {
  __m256i gt = _mm256_cmpgt_epi32(n, _mm256_set1_epi32(-126));
  __m256i eq = _mm256_cmpeq_epi32(n, _mm256_set1_epi32(-126));
  __m256 ge1 = _mm256_cmp_ps(w, c8(1.0f), _CMP_GE_OQ);
  return _mm256_or_ps(_mm256_castsi256_ps(gt), _mm256_and_ps(_mm256_castsi256_ps(eq), ge1));
}

// ls::cexp on 8 lanes; *slow gets the lanes (bit mask) that need the
// subnormal-result branch and must be redone by the scalar function.
inline __m256 exp8(__m256 x, int* slow) {
  __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  __m256 over = _mm256_cmp_ps(x, c8(88.72283172607421875f), _CMP_GT_OQ);
  __m256 under = _mm256_cmp_ps(x, c8(-103.97207641601562f), _CMP_LT_OQ);
  Parts8 e = exp_parts8(x);
  __m256 w = _mm256_add_ps(e.a, e.b);
  __m256 normal = normal8(e.n, w);
  // n == 128: (w * 2^127) * 2, as 2^128 is not a float.
  __m256i n128 = _mm256_cmpeq_epi32(e.n, _mm256_set1_epi32(128));
  __m256 y = _mm256_mul_ps(w, pow2_normal8(_mm256_min_epi32(e.n, _mm256_set1_epi32(127))));
  y = sel8(_mm256_castsi256_ps(n128), _mm256_mul_ps(y, c8(2.0f)), y);
  __m256 special = _mm256_or_ps(is_nan, _mm256_or_ps(over, under));
  *slow = ~_mm256_movemask_ps(_mm256_or_ps(special, normal)) & 0xff;
  y = sel8(under, _mm256_setzero_ps(), y);
  y = sel8(over, c8(cmath_detail::inf()), y);
  return sel8(is_nan, c8(cmath_detail::nan()), y);
}

// ls::csigmoid on 8 lanes; *slow as for exp8 (|x| in about [87.34, 103.97]).
inline __m256 sigmoid8(__m256 x, int* slow) {
  __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
  __m256 m = sel8(pos, neg8(x), x);  // -|x|
  Parts8 e = exp_parts8(m);
  // Both branches take exp_parts(m): exp_dd for m >= -80, cexp below.
  __m256 w = _mm256_add_ps(e.a, e.b);
  __m256 w_lo = _mm256_add_ps(_mm256_sub_ps(e.a, w), e.b);
  __m256 s = pow2_normal8(e.n);  // n >= -116 where exp_dd is used
  __m256 hi = _mm256_mul_ps(w, s);
  __m256 lo = _mm256_mul_ps(w_lo, s);
  // m < -80: cexp(m), which is hi when normal (n <= 0: no n == 128 case).
  __m256 far = _mm256_cmp_ps(m, c8(-80.0f), _CMP_LT_OQ);
  __m256 under = _mm256_cmp_ps(m, c8(-103.97207641601562f), _CMP_LT_OQ);
  __m256 normal = normal8(e.n, w);
  __m256 need = _mm256_andnot_ps(_mm256_or_ps(_mm256_or_ps(under, normal), is_nan), far);
  *slow = _mm256_movemask_ps(need);
  __m256 ev = sel8(under, _mm256_setzero_ps(), hi);
  __m256 ev_lo = sel8(far, _mm256_setzero_ps(), lo);
  __m256 num = sel8(pos, c8(1.0f), ev);
  __m256 num_lo = sel8(pos, _mm256_setzero_ps(), ev_lo);
  __m256 d = _mm256_add_ps(c8(1.0f), ev);
  __m256 d_lo = _mm256_add_ps(_mm256_add_ps(_mm256_sub_ps(c8(1.0f), d), ev), ev_lo);
  __m256 q = _mm256_div_ps(num, d);
  __m256 res = _mm256_fnmadd_ps(q, d, num);
  __m256 corr = _mm256_div_ps(_mm256_add_ps(res, _mm256_sub_ps(num_lo, _mm256_mul_ps(q, d_lo))), d);
  __m256 y = _mm256_add_ps(q, corr);
  return sel8(is_nan, c8(cmath_detail::nan()), y);
}

// Runs kernel K over n elements (input v = pre(x[i])), 8 at a time, the
// tail through a zero-padded buffer; flagged lanes get scalar(v).
template <typename Pre, typename Kernel, typename Scalar>
inline void run8(const float* x, float* y, int64_t n, Pre pre, Kernel kernel, Scalar scalar) {
  alignas(32) float v_lanes[8];
  auto block = [&](const float* in, float* out) {
    __m256 v = pre(_mm256_loadu_ps(in));
    int slow;
    __m256 r = kernel(v, &slow);
    _mm256_storeu_ps(out, r);
    if (slow) {  // rare: redo those lanes exactly, from v (in may be out)
      _mm256_store_ps(v_lanes, v);
      for (int j = 0; j < 8; ++j)
        if (slow >> j & 1) out[j] = scalar(v_lanes[j]);
    }
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) block(x + i, y + i);
  if (i < n) {
    float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(buf, x + i, (size_t)(n - i) * sizeof(float));
    block(buf, buf);
    memcpy(y + i, buf, (size_t)(n - i) * sizeof(float));
  }
}

inline __m256 identity8(__m256 v) { return v; }
inline float cexp_s(float v) { return ls::cexp(v); }
inline float csigmoid_s(float v) { return ls::csigmoid(v); }

}  // namespace

// ---------------------------------------------------------- public API ----
void exp_n(const float* x, float* y, int64_t n) {
  if (local_numerics()) return local::exp_n(x, y, n);
  switch (effective_path()) {
    case GemmPath::kAvx512:
      return internal::exp_n_avx512(x, y, n);
    case GemmPath::kAvx2:
      return run8(x, y, n, identity8, exp8, cexp_s);
    default:
      for (int64_t i = 0; i < n; ++i) y[i] = ls::cexp(x[i]);
  }
}

void sigmoid_n(const float* x, float* y, int64_t n) {
  if (local_numerics()) return local::sigmoid_n(x, y, n);
  switch (effective_path()) {
    case GemmPath::kAvx512:
      return internal::sigmoid_n_avx512(x, y, n);
    case GemmPath::kAvx2:
      return run8(x, y, n, identity8, sigmoid8, csigmoid_s);
    default:
      for (int64_t i = 0; i < n; ++i) y[i] = ls::csigmoid(x[i]);
  }
}

void exp_shifted_n(const float* x, float m, float* y, int64_t n) {
  if (local_numerics()) return local::exp_shifted_n(x, m, y, n);
  switch (effective_path()) {
    case GemmPath::kAvx512:
      return internal::exp_shifted_n_avx512(x, m, y, n);
    case GemmPath::kAvx2: {
      const __m256 mv = _mm256_set1_ps(m);
      return run8(x, y, n, [mv](__m256 v) { return _mm256_sub_ps(v, mv); }, exp8, cexp_s);
    }
    default:
      for (int64_t i = 0; i < n; ++i) y[i] = ls::cexp(x[i] - m);
  }
}

void set_vmath_path(GemmPath path) { g_forced.store(static_cast<int>(path)); }

bool vmath_path_supported(GemmPath path) { return gemm_path_supported(path); }

const char* vmath_path_name() { return path_name(effective_path()); }

}  // namespace ops
}  // namespace ls
