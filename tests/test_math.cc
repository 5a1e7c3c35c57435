// Contract math (contract_math.h) against double-precision libm: dense
// bit-pattern sweeps plus random points, special values, symmetry, and
// independence from vectorization. Error unit: ulps of the float nearest
// the double reference (subnormal ulp = 2^-149). docs/MATH.md reports the
// measured maxima; this suite reproduces them (MESSAGE lines).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bits.h"
#include "contract.h"

namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const uint32_t kCanonicalNaN = 0x7fc00000u;

double ulp_of(double ref) {
  double a = std::fabs((double)(float)ref);
  if (a < 0x1p-126) return 0x1p-149;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0, e - 24);
}

// Error of `got` in ulps of the rounded reference; infinities must match.
double ulp_error(float got, double ref) {
  float ref_f = (float)ref;
  if (std::isinf(ref_f) || std::isinf(got)) return ref_f == got ? 0.0 : 1e30;
  if (std::isnan(got)) return 1e30;
  return std::fabs((double)got - ref) / ulp_of(ref);
}

// Total order on floats as integers, so a range is swept by bit pattern.
int64_t ordered(float x) {
  int32_t u = (int32_t)ls::bits(x);
  return u < 0 ? (int64_t)INT32_MIN - u : (int64_t)u;
}
float unordered(int64_t o) {
  return o < 0 ? ls::from_bits((uint32_t)(int32_t)((int64_t)INT32_MIN - o))
               : ls::from_bits((uint32_t)o);
}

struct MaxErr {
  double ulps = 0.0;
  float at = 0.0f;
  int64_t points = 0;
  void add(float x, double e) {
    ++points;
    if (e > ulps) {
      ulps = e;
      at = x;
    }
  }
};

// Every `stride`-th float of [lo, hi] by bit pattern (about `target`
// points), both ends, plus `randoms` Philox points: random bit patterns
// inside [lo, hi] and values uniform in [lo, hi].
template <class F, class R>
MaxErr sweep(F f, R ref, float lo, float hi, int64_t target, int64_t randoms) {
  MaxErr m;
  auto one = [&](float x) { m.add(x, ulp_error(f(x), ref((double)x))); };
  int64_t olo = ordered(lo), ohi = ordered(hi);
  int64_t stride = (ohi - olo) / target | 1;  // odd: hits every residue class
  for (int64_t o = olo; o <= ohi; o += stride) one(unordered(o));
  one(lo);
  one(hi);
  for (int64_t i = 0; i < randoms; ++i) {
    uint64_t r = ls::random_u64(7, ls::Purpose::kTest, (uint64_t)i);
    one(unordered(olo + (int64_t)(r % (uint64_t)(ohi - olo + 1))));
    float u = ls::random_unit(8, ls::Purpose::kTest, (uint64_t)i);
    float v = lo + (hi - lo) * u;
    if (v >= lo && v <= hi) one(v);
  }
  return m;
}

double ref_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Called through a volatile pointer so the compiler sees one scalar call.
__attribute__((noinline)) float call_one(float (*f)(float), float x) { return f(x); }

const int64_t kTarget = 3000000;  // sweep points per function
const int64_t kRandoms = 200000;

}  // namespace

TEST_SUITE("math") {
  TEST_CASE("cexp: max ulp over [-104, 89]") {
    MaxErr m = sweep(ls::cexp, [](double x) { return std::exp(x); }, -104.0f, 89.0f,
                     kTarget, kRandoms);
    MESSAGE("cexp max ulp " << m.ulps << " at " << m.at << " (" << m.points << " points)");
    CHECK(m.ulps <= 1.0);
  }

  TEST_CASE("clog: max ulp over all positive floats, subnormals included") {
    MaxErr m = sweep(ls::clog, [](double x) { return std::log(x); }, ls::from_bits(1u),
                     std::numeric_limits<float>::max(), kTarget, kRandoms);
    MaxErr near1 = sweep(ls::clog, [](double x) { return std::log(x); }, 0.5f, 2.0f,
                         kTarget / 4, kRandoms / 4);
    MESSAGE("clog max ulp " << m.ulps << " at " << m.at << "; near 1: " << near1.ulps
                            << " at " << near1.at);
    CHECK(m.ulps <= 1.0);
    CHECK(near1.ulps <= 1.0);
  }

  TEST_CASE("ctanh: max ulp over [-12, 12]") {
    MaxErr m = sweep(ls::ctanh, [](double x) { return std::tanh(x); }, -12.0f, 12.0f,
                     kTarget, kRandoms);
    MESSAGE("ctanh max ulp " << m.ulps << " at " << m.at);
    CHECK(m.ulps <= 1.0);
  }

  TEST_CASE("csigmoid: max ulp over [-110, 30]") {
    MaxErr m = sweep(ls::csigmoid, ref_sigmoid, -110.0f, 30.0f, kTarget, kRandoms);
    MESSAGE("csigmoid max ulp " << m.ulps << " at " << m.at);
    CHECK(m.ulps <= 1.0);
  }

  TEST_CASE("csin, ccos: max ulp over [-1e4, 1e4] and over the whole float range") {
    auto rs = [](double x) { return std::sin(x); };
    auto rc = [](double x) { return std::cos(x); };
    MaxErr s = sweep(ls::csin, rs, -1e4f, 1e4f, kTarget, kRandoms);
    MaxErr c = sweep(ls::ccos, rc, -1e4f, 1e4f, kTarget, kRandoms);
    const float big = std::numeric_limits<float>::max();
    MaxErr sb = sweep(ls::csin, rs, 1e4f, big, kTarget / 3, kRandoms / 4);
    MaxErr cb = sweep(ls::ccos, rc, 1e4f, big, kTarget / 3, kRandoms / 4);
    // Around the switch from Cody-Waite to Payne-Hanek.
    MaxErr sw = sweep(ls::csin, rs, 6.0e4f, 7.0e4f, kTarget / 10, 0);
    MESSAGE("csin max ulp " << s.ulps << " at " << s.at << "; |x|>1e4: " << sb.ulps << " at "
                            << sb.at << "; near switch: " << sw.ulps);
    MESSAGE("ccos max ulp " << c.ulps << " at " << c.at << "; |x|>1e4: " << cb.ulps << " at "
                            << cb.at);
    CHECK(s.ulps <= 1.0);
    CHECK(c.ulps <= 1.0);
    CHECK(sb.ulps <= 1.0);
    CHECK(cb.ulps <= 1.0);
    CHECK(sw.ulps <= 1.0);
  }

  TEST_CASE("cexp: special values, overflow and gradual underflow") {
    CHECK_SAME_BITS(ls::cexp(0.0f), 1.0f);
    CHECK_SAME_BITS(ls::cexp(-0.0f), 1.0f);
    CHECK_SAME_BITS(ls::cexp(1e-30f), 1.0f);
    CHECK_SAME_BITS(ls::cexp(-1e-30f), 1.0f);
    CHECK_SAME_BITS(ls::cexp(ls::from_bits(1u)), 1.0f);
    CHECK_SAME_BITS(ls::cexp(-kInf), 0.0f);
    CHECK_SAME_BITS(ls::cexp(kInf), kInf);
    CHECK(ls::bits(ls::cexp(kNaN)) == kCanonicalNaN);
    CHECK(ls::bits(ls::cexp(-kNaN)) == kCanonicalNaN);
    // Overflow boundary: ln(FLT_MAX) = 88.7228391 lies between these floats.
    CHECK(std::isfinite(ls::cexp(88.72283172607421875f)));
    CHECK(ls::cexp(88.72283172607421875f) > 3.4e38f);
    CHECK_SAME_BITS(ls::cexp(88.72283935546875f), kInf);
    CHECK_SAME_BITS(ls::cexp(1000.0f), kInf);
    // Underflow boundary: ln(2^-150) = -103.9720771 lies between these.
    CHECK_SAME_BITS(ls::cexp(-103.97207641601562f), ls::from_bits(1u));
    CHECK_SAME_BITS(ls::cexp(-103.97208404541016f), 0.0f);
    CHECK_SAME_BITS(ls::cexp(-1000.0f), 0.0f);
    // Every subnormal result, bit pattern by bit pattern, within 1 ulp and
    // monotone (no flush to zero anywhere).
    float prev = 0.0f;
    for (float x = -103.97207641601562f; x < -87.33654f; x = std::nextafter(x, 0.0f)) {
      float y = ls::cexp(x);
      REQUIRE(y > 0.0f);
      REQUIRE(y >= prev);
      REQUIRE(ulp_error(y, std::exp((double)x)) <= 1.0);
      prev = y;
    }
    CHECK(std::fabs(ls::cexp(-87.33654f)) < 1.2e-38f * 1.01f);  // near FLT_MIN
  }

  TEST_CASE("clog: special values and subnormals") {
    CHECK_SAME_BITS(ls::clog(1.0f), 0.0f);
    CHECK_SAME_BITS(ls::clog(0.0f), -kInf);
    CHECK_SAME_BITS(ls::clog(-0.0f), -kInf);
    CHECK_SAME_BITS(ls::clog(kInf), kInf);
    CHECK(ls::bits(ls::clog(-1.0f)) == kCanonicalNaN);
    CHECK(ls::bits(ls::clog(-kInf)) == kCanonicalNaN);
    CHECK(ls::bits(ls::clog(-ls::from_bits(1u))) == kCanonicalNaN);
    CHECK(ls::bits(ls::clog(kNaN)) == kCanonicalNaN);
    CHECK(ulp_error(ls::clog(ls::from_bits(1u)), std::log(0x1p-149)) <= 0.5);
    CHECK(ulp_error(ls::clog(std::numeric_limits<float>::max()),
                    std::log((double)std::numeric_limits<float>::max())) <= 0.5);
    // Every subnormal by a small stride, and the largest ones exhaustively.
    for (uint32_t u = 1; u < 0x00800000u; u += (u < 0x007f0000u ? 97u : 1u)) {
      float x = ls::from_bits(u);
      REQUIRE(ulp_error(ls::clog(x), std::log((double)x)) <= 1.0);
    }
  }

  TEST_CASE("ctanh: special values, odd symmetry, tiny and large arguments") {
    CHECK_SAME_BITS(ls::ctanh(0.0f), 0.0f);
    CHECK_SAME_BITS(ls::ctanh(-0.0f), -0.0f);
    CHECK_SAME_BITS(ls::ctanh(kInf), 1.0f);
    CHECK_SAME_BITS(ls::ctanh(-kInf), -1.0f);
    CHECK(ls::bits(ls::ctanh(kNaN)) == kCanonicalNaN);
    for (float x : {9.1f, 10.0f, 20.0f, 45.0f, 100.0f, 3.0e38f}) {
      CHECK_SAME_BITS(ls::ctanh(x), 1.0f);
      CHECK_SAME_BITS(ls::ctanh(-x), -1.0f);
    }
    // tanh(x) = x exactly wherever x^3/3 is below half an ulp of x.
    for (float x : {1e-30f, 1e-10f, 1e-5f, 2.4e-4f, ls::from_bits(1u), 1.0e-39f}) {
      CHECK_SAME_BITS(ls::ctanh(x), x);
      CHECK_SAME_BITS(ls::ctanh(-x), -x);
    }
    // Exactly odd, bit for bit, and bounded by 1.
    for (uint32_t u = 0; u < 0x7f800000u; u += 9973u) {
      float x = ls::from_bits(u);
      float t = ls::ctanh(x);
      REQUIRE(ls::bits(ls::ctanh(-x)) == (ls::bits(t) ^ 0x80000000u));
      REQUIRE(t <= 1.0f);
    }
  }

  TEST_CASE("csigmoid: special values, both tails, no overflow or cancellation") {
    CHECK_SAME_BITS(ls::csigmoid(0.0f), 0.5f);
    CHECK_SAME_BITS(ls::csigmoid(-0.0f), 0.5f);
    CHECK_SAME_BITS(ls::csigmoid(kInf), 1.0f);
    CHECK_SAME_BITS(ls::csigmoid(-kInf), 0.0f);
    CHECK(ls::bits(ls::csigmoid(kNaN)) == kCanonicalNaN);
    CHECK_SAME_BITS(ls::csigmoid(100.0f), 1.0f);
    CHECK_SAME_BITS(ls::csigmoid(3.0e38f), 1.0f);
    CHECK_SAME_BITS(ls::csigmoid(-3.0e38f), 0.0f);
    // The negative tail follows e^x into the subnormals instead of 1/inf.
    for (float x : {-20.0f, -50.0f, -88.0f, -90.0f, -100.0f, -103.0f}) {
      float y = ls::csigmoid(x);
      CHECK(y > 0.0f);
      CHECK(ulp_error(y, ref_sigmoid((double)x)) <= 1.0);
    }
    CHECK_SAME_BITS(ls::csigmoid(-110.0f), 0.0f);
    // Small |x|: sigma(x) - 1/2 is about x/4 with no cancellation trouble.
    for (float x : {1e-8f, -1e-8f, 1e-3f, -1e-3f}) {
      CHECK(ulp_error(ls::csigmoid(x), ref_sigmoid((double)x)) <= 1.0);
    }
  }

  TEST_CASE("csin, ccos: special values and symmetry") {
    CHECK_SAME_BITS(ls::csin(0.0f), 0.0f);
    CHECK_SAME_BITS(ls::csin(-0.0f), -0.0f);
    CHECK_SAME_BITS(ls::ccos(0.0f), 1.0f);
    CHECK_SAME_BITS(ls::ccos(-0.0f), 1.0f);
    for (float x : {kInf, -kInf, kNaN}) {
      CHECK(ls::bits(ls::csin(x)) == kCanonicalNaN);
      CHECK(ls::bits(ls::ccos(x)) == kCanonicalNaN);
    }
    for (float x : {1e-30f, 1e-10f, 1e-4f, ls::from_bits(1u), 1.0e-39f}) {
      CHECK_SAME_BITS(ls::csin(x), x);
      CHECK_SAME_BITS(ls::csin(-x), -x);
      CHECK_SAME_BITS(ls::ccos(x), 1.0f);
    }
    // Arguments next to multiples of pi/2, where reduction cancels.
    for (float x : {3.14159274f, 1.57079637f, 4.71238899f, 6.28318548f, 355.0f,
                    103993.0f, 8.5e4f, 1.0e4f, 16367173.0f * 0x1p72f}) {
      CHECK(ulp_error(ls::csin(x), std::sin((double)x)) <= 1.0);
      CHECK(ulp_error(ls::ccos(x), std::cos((double)x)) <= 1.0);
    }
    for (uint32_t u = 0; u < 0x7f800000u; u += 99991u) {
      float x = ls::from_bits(u);
      REQUIRE(ls::bits(ls::csin(-x)) == (ls::bits(ls::csin(x)) ^ 0x80000000u));
      REQUIRE(ls::bits(ls::ccos(-x)) == ls::bits(ls::ccos(x)));
    }
  }

  TEST_CASE("results do not depend on vectorization or inlining") {
    // A plain loop the compiler may vectorize and inline, against one call
    // at a time through a volatile function pointer and a noinline wrapper.
    const int n = 10000;
    std::vector<float> in(n), out(n);
    for (int i = 0; i < n; ++i) {
      uint32_t r = ls::random_u32(11, ls::Purpose::kTest, (uint64_t)i);
      in[i] = ls::from_bits(r % 4 == 0 ? r : (r & 0x807fffffu) | ((0x78u + r % 24u) << 23));
    }
    struct Fn {
      const char* name;
      float (*f)(float);
    };
    const Fn fns[] = {{"cexp", ls::cexp},         {"clog", ls::clog}, {"ctanh", ls::ctanh},
                      {"csigmoid", ls::csigmoid}, {"csin", ls::csin}, {"ccos", ls::ccos}};
#define LS_LOOP(F) \
  for (int i = 0; i < n; ++i) out[i] = F(in[i])
    for (const Fn& fn : fns) {
      std::string name = fn.name;
      if (name == "cexp") LS_LOOP(ls::cexp);
      if (name == "clog") LS_LOOP(ls::clog);
      if (name == "ctanh") LS_LOOP(ls::ctanh);
      if (name == "csigmoid") LS_LOOP(ls::csigmoid);
      if (name == "csin") LS_LOOP(ls::csin);
      if (name == "ccos") LS_LOOP(ls::ccos);
      float (*volatile vf)(float) = fn.f;
      int mismatches = 0;
      for (int i = 0; i < n; ++i) mismatches += ls::bits(call_one(vf, in[i])) != ls::bits(out[i]);
      INFO(name);
      CHECK(mismatches == 0);
    }
#undef LS_LOOP
  }
}
