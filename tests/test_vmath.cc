// Batch contract math (ops/vmath.h) against the scalar functions of
// contract_math.h, bit for bit, on every forced path: dense bit-pattern
// sweeps of the whole float range, every float of the regions where the
// branches switch (cexp's subnormal results included), random inputs,
// special values, all lengths 0..67 at unaligned offsets, in place.
// A MESSAGE line reports elements/second per path (not asserted).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "contract.h"
#include "ops/vmath.h"

namespace {

using ls::ops::GemmPath;

// The forced paths this CPU can run (scalar always).
std::vector<GemmPath> paths() {
  std::vector<GemmPath> out = {GemmPath::kScalar};
  for (GemmPath p : {GemmPath::kAvx2, GemmPath::kAvx512})
    if (ls::ops::vmath_path_supported(p)) out.push_back(p);
  return out;
}

// Restores kAuto when a test case ends, however it ends.
struct PathGuard {
  ~PathGuard() { ls::ops::set_vmath_path(GemmPath::kAuto); }
};

enum class Fn { kExp, kSigmoid, kExpShifted };

std::string fn_name(Fn f) {
  return f == Fn::kExp ? "exp_n" : f == Fn::kSigmoid ? "sigmoid_n" : "exp_shifted_n";
}

// The definition the batch functions must match, one scalar call each.
float scalar_ref(Fn f, float x, float m) {
  switch (f) {
    case Fn::kExp:
      return ls::cexp(x);
    case Fn::kSigmoid:
      return ls::csigmoid(x);
    default:
      return ls::cexp(x - m);
  }
}

void call(Fn f, const float* x, float m, float* y, int64_t n) {
  switch (f) {
    case Fn::kExp:
      return ls::ops::exp_n(x, y, n);
    case Fn::kSigmoid:
      return ls::ops::sigmoid_n(x, y, n);
    default:
      return ls::ops::exp_shifted_n(x, m, y, n);
  }
}

// Equal bits, or both NaN (the contract makes every NaN 0x7fc00000, so in
// practice NaNs match bit for bit too; that is checked separately).
bool same(float a, float b) {
  bool na = (ls::bits(a) & 0x7fffffffu) > 0x7f800000u;
  bool nb = (ls::bits(b) & 0x7fffffffu) > 0x7f800000u;
  return na || nb ? na && nb : ls::bits(a) == ls::bits(b);
}

std::string hex(float v) {
  char buf[16];
  snprintf(buf, sizeof buf, "0x%08x", (unsigned)ls::bits(v));
  return buf;
}

// Runs f on `in` on every path; counts elements differing from scalar_ref.
// Reports the first difference with its input.
int64_t mismatches(Fn f, const std::vector<float>& in, float m = 0.0f) {
  PathGuard guard;
  std::vector<float> ref(in.size()), got(in.size());
  for (size_t i = 0; i < in.size(); ++i) ref[i] = scalar_ref(f, in[i], m);
  int64_t bad = 0;
  for (GemmPath p : paths()) {
    ls::ops::set_vmath_path(p);
    call(f, in.data(), m, got.data(), (int64_t)in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      if (same(got[i], ref[i])) continue;
      if (bad++ == 0)
        MESSAGE(fn_name(f) << " path " << std::string(ls::ops::vmath_path_name())
                           << ": x=" << hex(in[i]) << " m=" << hex(m) << " got "
                           << hex(got[i]) << " want " << hex(ref[i]));
    }
  }
  return bad;
}

// Every `stride`-th bit pattern from lo to hi (inclusive, as uint32),
// checked in chunks to bound memory.
int64_t sweep_bits(Fn f, uint64_t lo, uint64_t hi, uint64_t stride) {
  int64_t bad = 0;
  std::vector<float> in;
  for (uint64_t u = lo; u <= hi; u += stride) {
    in.push_back(ls::from_bits((uint32_t)u));
    if (in.size() == (1u << 16)) {
      bad += mismatches(f, in);
      in.clear();
    }
  }
  if (!in.empty()) bad += mismatches(f, in);
  return bad;
}

// Every float from a to b (same sign, |a| <= |b|) by bit pattern.
int64_t sweep_range(Fn f, float a, float b, uint64_t stride = 1) {
  return sweep_bits(f, ls::bits(a), ls::bits(b), stride);
}

std::vector<float> special_values() {
  std::vector<uint32_t> u = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                             0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu,
                             0x7f7fffffu, 0xff7fffffu, 0x00000001u, 0x80000001u, 0x00800000u,
                             0x80800000u, 0x3f800000u, 0xbf800000u};
  std::vector<float> out;
  for (uint32_t v : u) out.push_back(ls::from_bits(v));
  // Branch thresholds of cexp/csigmoid and a few ulps around them.
  for (float t : {88.72283172607421875f, -103.97207641601562f, -80.0f, 80.0f, -87.33654022216797f,
                  87.33654022216797f, 103.97207641601562f, -88.72283172607421875f})
    for (int d = -4; d <= 4; ++d) out.push_back(ls::from_bits(ls::bits(t) + d));
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_SUITE("vmath") {
  TEST_CASE("dense sweep of all float bit patterns") {
    // Every 509th pattern (prime, so low mantissa bits vary): ~8.4M inputs
    // covering subnormals, normals, infinities and NaNs of both signs.
    for (Fn f : {Fn::kExp, Fn::kSigmoid}) CHECK(sweep_bits(f, 0, 0xffffffffu, 509) == 0);
  }

  TEST_CASE("every float where the branches switch") {
    // cexp: the whole subnormal-result range and the overflow edge.
    CHECK(sweep_range(Fn::kExp, -86.0f, -105.0f) == 0);
    CHECK(sweep_range(Fn::kExp, 88.0f, 89.0f) == 0);
    // csigmoid: exp_dd / cexp switch at |x| = 80, the subnormal tail, the
    // zero tail; both signs (m = -|x|). Every 3rd float, ~1M each.
    CHECK(sweep_range(Fn::kSigmoid, -79.0f, -106.0f, 3) == 0);
    CHECK(sweep_range(Fn::kSigmoid, 79.0f, 106.0f, 3) == 0);
    // Around zero: tiny and subnormal inputs of both signs.
    for (Fn f : {Fn::kExp, Fn::kSigmoid}) {
      CHECK(sweep_bits(f, 0, 0x00100000u, 1) == 0);
      CHECK(sweep_bits(f, 0x80000000u, 0x80100000u, 1) == 0);
    }
  }

  TEST_CASE("special values, NaNs canonical") {
    std::vector<float> in = special_values();
    for (Fn f : {Fn::kExp, Fn::kSigmoid, Fn::kExpShifted}) CHECK(mismatches(f, in, 1.5f) == 0);
    PathGuard guard;
    std::vector<float> nans = {ls::from_bits(0x7f800001u), ls::from_bits(0xffc12345u),
                               ls::from_bits(0x7fffffffu)};
    for (int i = 0; i < 20; ++i) nans.push_back(nans[i % 3]);
    std::vector<float> out(nans.size());
    for (GemmPath p : paths()) {
      ls::ops::set_vmath_path(p);
      for (Fn f : {Fn::kExp, Fn::kSigmoid, Fn::kExpShifted}) {
        call(f, nans.data(), 0.0f, out.data(), (int64_t)out.size());
        for (float v : out) CHECK(ls::bits(v) == 0x7fc00000u);
      }
    }
  }

  TEST_CASE("random inputs") {
    std::vector<float> bitsv, uniform, wide;
    for (uint64_t i = 0; i < 400000; ++i) {
      bitsv.push_back(ls::from_bits(ls::random_u32(7, ls::Purpose::kTest, i)));
      float u = ls::random_unit(7, ls::Purpose::kTest, i + (1ull << 40));
      uniform.push_back(ls::fma(u, 240.0f, -120.0f));
      wide.push_back(ls::fma(u, 30.0f, -15.0f));
    }
    for (Fn f : {Fn::kExp, Fn::kSigmoid}) {
      CHECK(mismatches(f, bitsv) == 0);
      CHECK(mismatches(f, uniform) == 0);
      CHECK(mismatches(f, wide) == 0);
    }
  }

  TEST_CASE("exp_shifted_n: softmax rows and odd shifts") {
    // Rows of logits shifted by their max (the softmax use), then shifts
    // that make x - m round, overflow, or hit inf/NaN.
    std::vector<float> row;
    for (uint64_t i = 0; i < 4096; ++i)
      row.push_back(ls::fma(ls::random_unit(11, ls::Purpose::kTest, i), 60.0f, -30.0f));
    float mx = row[0];
    for (float v : row) mx = v > mx ? v : mx;
    CHECK(mismatches(Fn::kExpShifted, row, mx) == 0);
    std::vector<float> sp = special_values();
    for (float m : {0.0f, -0.0f, 1e-7f, 3.25f, -50.5f, 100.0f, -100.0f, 1e30f, -1e30f,
                    ls::from_bits(0x7f800000u), ls::from_bits(0xff800000u),
                    ls::from_bits(0x7fc00000u)}) {
      CHECK(mismatches(Fn::kExpShifted, row, m) == 0);
      CHECK(mismatches(Fn::kExpShifted, sp, m) == 0);
    }
  }

  TEST_CASE("lengths 0..67, unaligned, in place, no stray writes") {
    PathGuard guard;
    // Inputs mix ordinary values with ones taking the rare lanes.
    std::vector<float> src(80);
    for (size_t i = 0; i < src.size(); ++i) {
      float u = ls::random_unit(13, ls::Purpose::kTest, i);
      src[i] = i % 7 == 3 ? ls::fma(u, -16.0f, -88.0f) : ls::fma(u, 200.0f, -100.0f);
    }
    const float kSentinel = ls::from_bits(0x7fa5a5a5u);
    for (GemmPath p : paths()) {
      ls::ops::set_vmath_path(p);
      for (Fn f : {Fn::kExp, Fn::kSigmoid, Fn::kExpShifted}) {
        for (int64_t n = 0; n <= 67; ++n) {
          for (int off = 0; off < 4; ++off) {
            std::vector<float> xs(n + 8), ys(n + 8, kSentinel);
            for (int64_t i = 0; i < n; ++i) xs[off + i] = src[i];
            call(f, xs.data() + off, 2.5f, ys.data() + off, n);
            bool ok = true;
            for (int64_t i = 0; i < n + 8; ++i) {
              bool inside = i >= off && i < off + n;
              float want = inside ? scalar_ref(f, src[i - off], 2.5f) : kSentinel;
              ok = ok && (inside ? same(ys[i], want) : ls::bits(ys[i]) == ls::bits(kSentinel));
            }
            // In place: y == x.
            call(f, xs.data() + off, 2.5f, xs.data() + off, n);
            for (int64_t i = 0; i < n; ++i)
              ok = ok && same(xs[off + i], scalar_ref(f, src[i], 2.5f));
            if (!ok)
              MESSAGE(fn_name(f) << " path " << std::string(ls::ops::vmath_path_name())
                                 << " n=" << n << " off=" << off);
            CHECK(ok);
          }
        }
      }
    }
  }

  TEST_CASE("speed (reported, not asserted)") {
    PathGuard guard;
    const int64_t kN = 4096;
    std::vector<float> x(kN), y(kN);
    for (int64_t i = 0; i < kN; ++i)
      x[i] = ls::fma(ls::random_unit(17, ls::Purpose::kTest, (uint64_t)i), 40.0f, -20.0f);
    for (Fn f : {Fn::kExp, Fn::kSigmoid, Fn::kExpShifted}) {
      std::string line = fn_name(f) + " Melem/s:";
      for (GemmPath p : paths()) {
        ls::ops::set_vmath_path(p);
        int64_t reps = 0;
        auto t0 = std::chrono::steady_clock::now();
        double t = 0;
        do {
          for (int r = 0; r < 16; ++r) call(f, x.data(), 3.0f, y.data(), kN);
          reps += 16;
          t = seconds_since(t0);
        } while (t < 0.1);
        char buf[64];
        snprintf(buf, sizeof buf, " %s %.0f", ls::ops::vmath_path_name(), reps * kN / t / 1e6);
        line += buf;
      }
      MESSAGE(line);
    }
  }
}
