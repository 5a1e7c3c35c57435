// Contract math: exp, log, tanh, sigmoid, sin, cos built only from binary32
// + - * / sqrt, explicit ls::fma, comparisons and bit manipulation, so the
// same input gives the same bits on host and device. Included by contract.h
// after LS_HD, ls::fma, ls::bits and ls::from_bits are defined.
// docs/MATH.md gives algorithms, supported ranges and measured ULP errors.
//
// Every NaN result is the canonical quiet NaN 0x7fc00000 (hardware NaN
// propagation differs between x86 and CUDA, so payloads are never passed on).
#pragma once

namespace ls {
namespace cmath_detail {

LS_HD bool is_nan(float x) { return (bits(x) & 0x7fffffffu) > 0x7f800000u; }
LS_HD float nan() { return from_bits(0x7fc00000u); }
LS_HD float inf() { return from_bits(0x7f800000u); }
LS_HD float abs(float x) { return from_bits(bits(x) & 0x7fffffffu); }
// |m| with the sign bit of s: exact, so odd functions stay odd bit for bit.
LS_HD float with_sign_of(float m, float s) {
  return from_bits((bits(m) & 0x7fffffffu) | (bits(s) & 0x80000000u));
}
// 2^n for -149 <= n <= 127, built from bits (subnormal powers included).
LS_HD float pow2(int n) {
  if (n >= -126) return from_bits((uint32_t)(n + 127) << 23);
  return from_bits(1u << (n + 149));
}
// Round-to-nearest-even of |v| < 2^22 to an integer, via the 1.5*2^23 trick:
// adding it pushes the fraction bits out, subtracting it back is exact.
constexpr float kRoundMagic = 12582912.0f;  // 0x1.8p23

}  // namespace cmath_detail

// ----------------------------------------------------------------- exp ----
// e^x = 2^n * e^(r + r_lo), n = rne(x/ln2), r + r_lo = x - n*ln2 carried as
// a double-float (2-part ln2; the first step is exact, the second uses
// TwoProd/TwoSum). e^(r + r_lo) = 1 + r + r^2*P(r) + r_lo*(1 + r), P degree 5
// (Cephes expf), summed as A + B with A = 1 + r exact in two parts, so the
// only large rounding is the last one. Results at or below 2^-126 are
// rounded once, directly onto the subnormal grid (no double rounding).
namespace cmath_detail {
// e^x = 2^n * (a + b), a + b in [0.7, 1.42], |b| < 2^-3 * a; finite
// -104 < x < 88.73 only.
struct ExpParts {
  int n;
  float a, b;
};
LS_HD ExpParts exp_parts(float x) {
  const float kLog2e = 1.44269502162933349609375f;   // rn(1/ln2)
  const float kLn2Hi = 0.693147182464599609375f;     // rn(ln2)
  const float kLn2Lo = -1.9046542121259336e-09f;     // rn(ln2 - kLn2Hi)
  float kf = ls::fma(x, kLog2e, kRoundMagic);
  int n = (int)(bits(kf) - bits(kRoundMagic));  // exact: |n| <= 151 < 2^22
  float nf = kf - kRoundMagic;
  float r1 = ls::fma(-nf, kLn2Hi, x);  // exact (|r1| < 0.5, lsb >= 2^-25)
  float ph = nf * kLn2Lo;
  float pl = ls::fma(nf, kLn2Lo, -ph);  // nf*kLn2Lo == ph + pl exactly
  float r = r1 - ph;                    // TwoSum(r1, -ph)
  float bv = r - r1;
  float r_lo = ((r1 - (r - bv)) + (-ph - bv)) - pl;
  float z = r * r;
  float p = 1.9875691500e-4f;
  p = ls::fma(p, r, 1.3981999507e-3f);
  p = ls::fma(p, r, 8.3334519073e-3f);
  p = ls::fma(p, r, 4.1665795894e-2f);
  p = ls::fma(p, r, 1.6666665459e-1f);
  p = ls::fma(p, r, 5.0000001201e-1f);
  float a = 1.0f + r;
  float a_lo = (1.0f - a) + r;  // Fast2Sum: 1 >= |r|
  ExpParts out = {n, a, a_lo + ls::fma(z, p, ls::fma(r, r_lo, r_lo))};
  return out;
}
// e^x as hi + lo (|lo| <= ulp(hi)/2) for -80 <= x <= 0, where both stay
// normal enough: used by csigmoid and ctanh to avoid a second rounding.
LS_HD void exp_dd(float x, float* hi, float* lo) {
  ExpParts e = exp_parts(x);
  float w = e.a + e.b;
  float w_lo = (e.a - w) + e.b;  // Fast2Sum
  float s = pow2(e.n);
  *hi = w * s;
  *lo = w_lo * s;
}
}  // namespace cmath_detail

LS_HD float cexp(float x) {
  using namespace cmath_detail;
  if (is_nan(x)) return nan();
  // ln(FLT_MAX) = 88.7228391...; the next float up overflows.
  if (x > 88.72283172607421875f) return inf();
  // e^x <= 2^-150 (half the least subnormal) rounds to +0; covers -inf.
  if (x < -103.97207641601562f) return 0.0f;
  ExpParts e = exp_parts(x);
  int n = e.n;
  float w = e.a + e.b;  // e^(r + r_lo)
  if (n > -126 || (n == -126 && w >= 1.0f)) {
    if (n == 128) return (w * pow2(127)) * 2.0f;  // 2^128 is not a float
    return w * pow2(n);  // exact: the result is normal
  }
  // Result <= 2^-126: v = (a + b) * 2^(n+149) < 2^23 counts units of 2^-149;
  // round it once to an integer with the 2^23 trick, a + b kept in two parts.
  float c = pow2(n + 149);
  float ca = c * e.a, cb = c * e.b;  // exact scalings
  const float kTwo23 = 8388608.0f;
  float h = kTwo23 + ca;
  float h_lo = ca - (h - kTwo23);  // Fast2Sum: 2^23 > ca
  float units = (h + (h_lo + cb)) - kTwo23;
  return units * from_bits(1u);  // exact: an integer <= 2^23 times 2^-149
}

// ----------------------------------------------------------------- log ----
// x = 2^e * m, m in [sqrt(1/2), sqrt(2)) (subnormals pre-scaled by 2^25),
// f = m - 1 exact. log(1+f) = f - f^2/2 + f^3*P(f), P degree 8 (Cephes logf).
// e*ln2 uses a 9-bit ln2_hi so e*ln2_hi is exact; e*ln2_hi + f is summed
// with Fast2Sum so the only large rounding is the final one.
LS_HD float clog(float x) {
  using namespace cmath_detail;
  if (is_nan(x) || x < 0.0f) return nan();
  if (x == 0.0f) return -inf();
  if (x == inf()) return x;
  int e = 0;
  if (x < 1.17549435e-38f) {  // subnormal: scale into the normal range (exact)
    x = x * 33554432.0f;      // 2^25
    e = -25;
  }
  uint32_t u = bits(x);
  e += (int)(u >> 23) - 127;
  float m = from_bits((u & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  if (m > 1.41421353816986083984375f) {  // rn(sqrt(2))
    m = m * 0.5f;
    e += 1;
  }
  float f = m - 1.0f;  // exact (Sterbenz)
  float z = f * f;
  float p = 7.0376836292e-2f;
  p = ls::fma(p, f, -1.1514610310e-1f);
  p = ls::fma(p, f, 1.1676998740e-1f);
  p = ls::fma(p, f, -1.2420140846e-1f);
  p = ls::fma(p, f, 1.4249322787e-1f);
  p = ls::fma(p, f, -1.6668057665e-1f);
  p = ls::fma(p, f, 2.0000714765e-1f);
  p = ls::fma(p, f, -2.4999993993e-1f);
  p = ls::fma(p, f, 3.3333331174e-1f);
  float ef = (float)e;
  const float kLn2Hi = 0.693359375f;        // 355/512: e*kLn2Hi is exact
  const float kLn2Lo = -2.12194440e-4f;     // ln2 - kLn2Hi
  float y = ls::fma(f * z, p, ef * kLn2Lo);  // f^3*P + e*ln2_lo
  y = ls::fma(-0.5f, z, y);
  float a = ef * kLn2Hi;
  float s = a + f;             // Fast2Sum: |a| >= |f| whenever a != 0
  float lo = (a - s) + f;      // exact rounding error of s
  return s + (lo + y);
}

// ---------------------------------------------------------------- tanh ----
// Computed on |x|, sign copied back (exactly odd). |x| < 0.625:
// x + x^3*P(x^2), P degree 4 (Cephes tanhf), no cancellation for tiny x.
// 0.625 <= |x| < 9.1: 1 - 2/(e^{2|x|} + 1) in double-float steps.
// |x| >= 9.1: exactly 1
// (1 - tanh(9.1) < 2^-25, so the rounded value is 1 there already).
LS_HD float ctanh(float x) {
  using namespace cmath_detail;
  if (is_nan(x)) return nan();
  float a = abs(x);
  float t;
  if (a < 0.625f) {
    float s = a * a;
    float p = -5.70498872745e-3f;
    p = ls::fma(p, s, 2.06390887954e-2f);
    p = ls::fma(p, s, -5.37397155531e-2f);
    p = ls::fma(p, s, 1.33314422036e-1f);
    p = ls::fma(p, s, -3.33332819422e-1f);
    t = ls::fma(a * s, p, a);
  } else if (a < 9.1f) {
    // 2/(e^{2a} + 1) as q + q_lo from e^{-2a} = eh + el (no overflow):
    // 2/(E + 1) = 2*e'/(1 + e'), then 1 - q by TwoSum.
    float eh, el;
    exp_dd(-(a + a), &eh, &el);
    float d = 1.0f + eh;
    float d_lo = ((1.0f - d) + eh) + el;  // Fast2Sum: 1 >= eh
    float num = eh + eh, num_lo = el + el;
    float q = num / d;
    float q_lo = (ls::fma(-q, d, num) + (num_lo - q * d_lo)) / d;
    float sum = 1.0f - q;  // TwoSum(1, -q)
    float bv = sum - 1.0f;
    float err = (1.0f - (sum - bv)) + (-q - bv);
    t = sum + (err - q_lo);
  } else {
    t = 1.0f;
  }
  return with_sign_of(t, x);
}

// ------------------------------------------------------------- sigmoid ----
// 1/(1 + e^-x) for x >= 0 (e^-x <= 1: no overflow), e^x/(1 + e^x) for
// x < 0 (e^x <= 1: no overflow, and tiny results underflow gradually
// with e^x instead of collapsing to 1/inf = 0). e^-|x| is taken as a
// double-float, 1 + e is kept exact, and the quotient gets one fma-based
// correction step, so essentially one final rounding remains.
LS_HD float csigmoid(float x) {
  using namespace cmath_detail;
  if (is_nan(x)) return nan();
  float m = x >= 0.0f ? -x : x;  // -|x|
  // e^m in [0, 1] as e + e_lo; below -80 the tail is dropped (e^x is then
  // so small that sigma(x) rounds like e^x itself).
  float e, e_lo = 0.0f;
  if (m >= -80.0f) {
    exp_dd(m, &e, &e_lo);
  } else {
    e = cexp(m);
  }
  float num = x >= 0.0f ? 1.0f : e;
  float num_lo = x >= 0.0f ? 0.0f : e_lo;
  float d = 1.0f + e;
  float d_lo = ((1.0f - d) + e) + e_lo;  // Fast2Sum: 1 >= e
  float q = num / d;
  float res = ls::fma(-q, d, num);  // exact remainder num - q*d
  return q + (res + (num_lo - q * d_lo)) / d;
}

// ------------------------------------------------------------ sin, cos ----
namespace cmath_detail {
// |x| = q*pi/2 + (r + r_lo) with q taken mod 4, |r| <~ pi/4, r_lo a tail
// below half an ulp of r.
struct TrigArg {
  float r, r_lo;
  uint32_t q;
};

// Below this |x| Cody-Waite is used, above it Payne-Hanek.
constexpr float kTrigCodyWaiteMax = 65536.0f;

// Cody-Waite with a 3-part pi/2 (P1 + P2 + P3 = pi/2 to ~2^-76) and fma.
// k = rne(a*2/pi) < 2^16; a - k*P1 is exact (|result| < 2, lsb >= 2^-23);
// the subtraction of k*P2 is done with TwoProd/TwoSum so nothing is lost
// when the result cancels.
LS_HD TrigArg trig_reduce_cw(float a) {
  const float k2OverPi = 0.636619746685028076171875f;  // rn(2/pi)
  const float kP1 = 1.57079637050628662109375f;        // rn(pi/2)
  const float kP2 = -4.371138828673793e-8f;            // rn(pi/2 - kP1)
  const float kP3 = -1.7151245100058819e-15f;          // rn(pi/2 - kP1 - kP2)
  float kf = ls::fma(a, k2OverPi, kRoundMagic);
  uint32_t q = bits(kf) - bits(kRoundMagic);
  float k = kf - kRoundMagic;
  float r1 = ls::fma(-k, kP1, a);
  float ph = k * kP2;
  float pl = ls::fma(k, kP2, -ph);  // k*kP2 == ph + pl exactly
  float s = r1 - ph;                // TwoSum(r1, -ph)
  float bv = s - r1;
  float se = (r1 - (s - bv)) + (-ph - bv);
  float tail = (se - pl) - k * kP3;
  float r = s + tail;
  TrigArg out = {r, (s - r) + tail, q & 3u};
  return out;
}

// 2/pi in binary, 32 bits a word, preceded by one zero word so that bit
// windows may start up to 31 bits before the binary point.
LS_HD uint32_t two_over_pi_word(int k) {
  switch (k) {
    case 1: return 0xA2F9836Eu;
    case 2: return 0x4E441529u;
    case 3: return 0xFC2757D1u;
    case 4: return 0xF534DDC0u;
    case 5: return 0xDB629599u;
    case 6: return 0x3C439041u;
    case 7: return 0xFE5163ABu;
    case 8: return 0xDEBBC561u;
    default: return 0u;
  }
}

// Payne-Hanek in integers, exact up to the truncated 2/pi tail.
// a = M*2^s (M 24-bit integer). Bits of 2/pi of weight above 2^(1-s) give
// multiples of 4 quadrants and are skipped; the next 64 bits G and 32 bits
// H give Y = a*(2/pi)*2^62 mod 2^64 = M*G (wrapping) + (M*H >> 32):
// two quadrant bits over 62 fraction bits.
LS_HD TrigArg trig_reduce_ph(float a) {
  uint32_t u = bits(a);
  int s = (int)(u >> 23) - 150;
  uint64_t m = (u & 0x007fffffu) | 0x00800000u;
  int p = s - 1 + 31;  // first needed bit (weight 2^-(s-1)), as a bit offset
  int k = p >> 5, sh = p & 31;
  uint32_t w0 = two_over_pi_word(k), w1 = two_over_pi_word(k + 1);
  uint32_t w2 = two_over_pi_word(k + 2), w3 = two_over_pi_word(k + 3);
  uint64_t hi = ((uint64_t)w0 << 32) | w1, lo = ((uint64_t)w2 << 32) | w3;
  uint64_t g = sh ? (hi << sh) | (lo >> (64 - sh)) : hi;
  uint32_t h = (uint32_t)((sh ? (lo << sh) : lo) >> 32);
  uint64_t y = m * g + ((m * h) >> 32);
  uint64_t q = (y + (1ull << 61)) >> 62;           // nearest quadrant
  int64_t f = (int64_t)(y - (q << 62));            // in [-2^61, 2^61)
  // r = f * 2^-62 * pi/2 with f split as fh + fl (both exact in binary32
  // to 2^-48 relative) and pi/2 as kC1 + kC2.
  float fh = (float)f;
  float fl = (float)(f - (int64_t)fh);
  const float kC1 = 0x1.921fb6p-62f;    // rn(pi/2) * 2^-62
  const float kC2 = -0x1.777a5cp-87f;   // rn(pi/2 - rn(pi/2)) * 2^-62
  float rh = fh * kC1;
  float tail = ls::fma(fh, kC1, -rh) + ls::fma(fh, kC2, fl * kC1);
  float r = rh + tail;
  TrigArg out = {r, (rh - r) + tail, (uint32_t)q & 3u};
  return out;
}

LS_HD TrigArg trig_reduce(float a) {
  return a < kTrigCodyWaiteMax ? trig_reduce_cw(a) : trig_reduce_ph(a);
}

// sin(r + r_lo), |r| <= pi/4: r + r^3*P(r^2) (+ r_lo*(1 - r^2/2)),
// P degree 2 (Cephes sinf).
LS_HD float sin_poly(float r, float r_lo) {
  float z = r * r;
  float p = -1.9515295891e-4f;
  p = ls::fma(p, z, 8.3321608736e-3f);
  p = ls::fma(p, z, -1.6666654611e-1f);
  float tail = ls::fma(r * z, p, ls::fma(-0.5f * z, r_lo, r_lo));
  return r + tail;
}
// cos(r + r_lo), |r| <= pi/4: 1 - r^2/2 + r^4*P(r^2) (- r*r_lo),
// P degree 2 (Cephes cosf). r^2 is carried as z + z_lo (TwoProd).
LS_HD float cos_poly(float r, float r_lo) {
  float z = r * r;
  float z_lo = ls::fma(r, r, -z);
  float p = 2.443315711809948e-5f;
  p = ls::fma(p, z, -1.388731625493765e-3f);
  p = ls::fma(p, z, 4.166664568298827e-2f);
  float h = 0.5f * z;
  float w = 1.0f - h;
  float w_err = (1.0f - w) - h;  // exact rounding error of w
  float tail = ls::fma(z * z, p, ls::fma(-r, r_lo, -0.5f * z_lo));
  return w + (w_err + tail);
}
}  // namespace cmath_detail

// sin(x) = sign(x) * sin(|x|) (exactly odd), over the whole float range;
// sin(+-inf) = NaN.
LS_HD float csin(float x) {
  using namespace cmath_detail;
  if (is_nan(x) || abs(x) == inf()) return nan();
  TrigArg t = trig_reduce(abs(x));
  float v;
  switch (t.q) {
    case 0: v = sin_poly(t.r, t.r_lo); break;
    case 1: v = cos_poly(t.r, t.r_lo); break;
    case 2: v = -sin_poly(t.r, t.r_lo); break;
    default: v = -cos_poly(t.r, t.r_lo); break;
  }
  return from_bits(bits(v) ^ (bits(x) & 0x80000000u));
}

// cos(x) = cos(|x|) (exactly even), whole float range; cos(+-inf) = NaN.
LS_HD float ccos(float x) {
  using namespace cmath_detail;
  if (is_nan(x) || abs(x) == inf()) return nan();
  TrigArg t = trig_reduce(abs(x));
  switch (t.q) {
    case 0: return cos_poly(t.r, t.r_lo);
    case 1: return -sin_poly(t.r, t.r_lo);
    case 2: return -cos_poly(t.r, t.r_lo);
    default: return sin_poly(t.r, t.r_lo);
  }
}

}  // namespace ls
