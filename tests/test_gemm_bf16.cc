// The contract's bf16 GEMM: every instruction-set path (amx's TDPBF16PS,
// and the avx512, avx2 and scalar replays) and the reference's plain loop
// equal ls::bf16_dot bit for bit, on shapes, strides, thread counts and edge
// values; the fold is not the fp32 one, nor vdpbf16ps's pair order. Where
// the CPU has AMX, the directed cases check the contract against hardware.
#include <doctest/doctest.h>

#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <cmath>
#include <vector>

#include "bits.h"
#include "numerics/contract.h"
#include "ops.h"  // the reference's ops (reference/ops.h)
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/leaf_fold.h"
#include "common/precision.h"

using ls::ops::Bf16Path;
using ls::ops::ConstMatBf16;

namespace {

// Restores kAuto when a test case ends, whatever it forced.
struct PathGuard {
  ~PathGuard() { ls::ops::set_gemm_bf16_path(Bf16Path::kAuto); }
};

std::vector<Bf16Path> paths_to_test() {
  std::vector<Bf16Path> out = {Bf16Path::kScalar};
  for (Bf16Path p : {Bf16Path::kAvx2, Bf16Path::kAvx512, Bf16Path::kAvx512Bf16, Bf16Path::kAmx}) {
    if (ls::ops::gemm_bf16_path_supported(p)) {
      out.push_back(p);
    } else {
      MESSAGE("CPU lacks " << ls::ops::bf16_path_name(p) << ": that path is not tested here");
    }
  }
  return out;
}

// Value classes of the inputs.
enum class Values {
  kPlain,     // to_bf16 of uniform [-1, 1)
  kSpecials,  // one in four: a bf16 subnormal, +-0, a tiny normal (subnormal
              // products), an fp32 value at a bf16 rounding tie, rarely +-inf or NaN
  kBoundary,  // exponents 2^-87..2^-48: products near 2^-126
};

uint16_t special_value(uint32_t u, uint16_t plain) {
  switch (u % 32) {
    case 0: return static_cast<uint16_t>(1 + (u >> 8) % 127);             // +subnormal
    case 1: return static_cast<uint16_t>(0x8000 | (1 + (u >> 8) % 127));  // -subnormal
    case 2: return 0x8000;                                                // -0
    case 3: return 0;                                                     // +0
    case 4:
    case 5: {  // tiny normals: 2^-100..2^-60, products below 2^-126
      const uint32_t e = 27 + (u >> 8) % 40;
      return static_cast<uint16_t>((u & 0x8000) | (e << 7) | ((u >> 16) & 0x7f));
    }
    case 6:
    case 7: {  // an fp32 value exactly halfway between two bf16: RNE picks the even one
      const uint32_t hi = (static_cast<uint32_t>(plain) << 16) | 0x8000u;
      return ls::to_bf16(ls::from_bits(hi));
    }
    case 8: return (u >> 8) % 16 == 0 ? 0x7f80 : plain;  // +inf, rarely
    case 9: return (u >> 8) % 16 == 0 ? 0xff80 : plain;  // -inf, rarely
    case 10: return (u >> 8) % 32 == 0 ? static_cast<uint16_t>(0x7fc0 | ((u >> 16) & 0x3f)) : plain;  // NaN
    default: return plain;
  }
}

void fill(std::vector<uint16_t>& v, uint64_t seed, Values kind) {
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t u = ls::random_u32(seed + 1000, ls::Purpose::kTest, i);
    uint16_t x = ls::to_bf16(ls::random_symmetric(seed, ls::Purpose::kTest, i, 1.0f));
    if (kind == Values::kSpecials) x = special_value(u, x);
    if (kind == Values::kBoundary) x = static_cast<uint16_t>((u & 0x807f) | ((40 + (u >> 8) % 40) << 7));
    v[i] = x;
  }
}

// C's start values: plain, or near 2^-126 (the flush boundary).
void fill_c(std::vector<float>& c, uint64_t seed, Values kind) {
  for (size_t i = 0; i < c.size(); ++i) {
    const uint32_t u = ls::random_u32(seed + 2000, ls::Purpose::kTest, i);
    c[i] = ls::random_symmetric(seed + 7, ls::Purpose::kTest, i, 1.0f);
    if (kind == Values::kBoundary)
      c[i] = ls::from_bits((u & 0x80000000u) |
                           (u % 4 == 0 ? 0x00800000u : ((u & 0x7fffffu) | ((1 + (u >> 23) % 3) << 23))));
    if (kind == Values::kSpecials && u % 8 == 0) c[i] = ls::from_bits((u & 0x80000000u) | ((u >> 4) & 0x7fffffu));
  }
}

// A stored with row stride / column stride chosen by layout:
// 0 row-major, 1 transposed (column-major), 2 padded rows, 3 neither stride 1.
struct View {
  std::vector<uint16_t> store;
  ConstMatBf16 m;
};
View make_view(int64_t rows, int64_t cols, int layout, uint64_t seed, Values kind) {
  View v;
  int64_t rs = cols, cs = 1, size = rows * cols;
  if (layout == 1) { rs = 1; cs = rows; }
  if (layout == 2) { rs = cols + 3; cs = 1; size = rows * rs; }
  if (layout == 3) { rs = 2; cs = 2 * rows + 1; size = cols * cs + 2; }
  v.store.assign(static_cast<size_t>(std::max<int64_t>(size, 1)), 0);
  fill(v.store, seed, kind);
  v.m = ConstMatBf16{v.store.data(), rs, cs};
  return v;
}

// Runs gemm_bf16 on every path with the given thread counts and checks each
// result against gemm_bf16_naive (ls::bf16_dot) on the same initial C.
void check_case(int64_t M, int64_t N, int64_t K, int la, int lb, bool accumulate, const std::vector<int>& threads,
                Values kind, uint64_t seed) {
  View a = make_view(M, K, la, seed, kind);
  View b = make_view(K, N, lb, seed + 1, kind);
  const int64_t ldc = N + (seed % 3 == 0 ? 5 : 0);
  std::vector<float> c0(static_cast<size_t>(std::max<int64_t>(M * ldc, 1)));
  fill_c(c0, seed + 2, kind);
  std::vector<float> want = c0;
  ls::ops::gemm_bf16_naive(M, N, K, a.m, b.m, want.data(), ldc, accumulate);
  for (Bf16Path p : paths_to_test()) {
    ls::ops::set_gemm_bf16_path(p);
    for (int t : threads) {
      std::vector<float> got = c0;
      ls::ops::gemm_bf16(M, N, K, a.m, b.m, got.data(), ldc, accumulate, t);
      INFO("M=" << M << " N=" << N << " K=" << K << " layoutA=" << la << " layoutB=" << lb << " acc=" << accumulate
                << " threads=" << t << " path=" << std::string(ls::ops::bf16_path_name(ls::ops::gemm_bf16_path())));
      CHECK_SAME_BITS(got, want);
    }
  }
}

// fp32 values for rounded operands: exact bf16 ties, subnormals, ordinary
// values, no inf or NaN (the edge-value case has those). `bounded`: no
// magnitude above 2^40 either, so no product or sum overflows: the leaf
// tree's fp32 adds pass a NaN on as the CPU's add does, which the contract
// leaves open (only the bf16 fold's NaN is canonical).
void fill_fp32(std::vector<float>& v, uint64_t seed, bool bounded = false) {
  uint64_t x = seed;
  for (float& f : v) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t u = static_cast<uint32_t>(x >> 32);
    if ((x >> 20) % 7 == 0) u = (u & 0xffff0000u) | 0x8000u;        // an exact tie
    if ((x >> 20) % 11 == 0) u &= 0x807fffffu;                     // a subnormal
    if ((x >> 20) % 13 == 0) u = (u & 0x3fffffffu) | 0x3c000000u;  // an ordinary value
    if (bounded && (u >> 23 & 0xffu) > 127 + 40) u = (u & 0x807fffffu) | ((127 + (u >> 23) % 40) << 23);
    f = ls::from_bits((u & 0x7f800000u) == 0x7f800000u ? (u & 0x3fffffffu) : u);
  }
}

}  // namespace

TEST_SUITE("gemm_bf16") {
  TEST_CASE("paths: forcing selects the path, kAuto picks the best supported") {
    PathGuard guard;
    ls::ops::set_gemm_bf16_path(Bf16Path::kScalar);
    CHECK(ls::ops::gemm_bf16_path() == Bf16Path::kScalar);
    ls::ops::set_gemm_bf16_path(Bf16Path::kAvx512);
    if (ls::ops::gemm_bf16_path_supported(Bf16Path::kAvx512)) CHECK(ls::ops::gemm_bf16_path() == Bf16Path::kAvx512);
    ls::ops::set_gemm_bf16_path(Bf16Path::kAuto);
    if (ls::ops::gemm_bf16_path_supported(Bf16Path::kAmx)) {
      CHECK(std::string(ls::ops::bf16_path_name(ls::ops::gemm_bf16_path())) == "amx");
    } else {
      MESSAGE("no AMX here; kAuto is " << ls::ops::bf16_path_name(ls::ops::gemm_bf16_path()));
    }
  }

  TEST_CASE("shapes sweep: K across 32-k blocks and the k block, edge tiles; every path and thread count") {
    PathGuard guard;
    const int64_t dims[] = {1, 7, 9, 31, 33, 65};
    const int64_t ks[] = {0, 1, 2, 3, 31, 32, 33, 63, 64, 65, 255, 256, 257, 513};
    uint64_t seed = 100;
    for (int64_t M : dims)
      for (int64_t N : dims)
        for (int64_t K : ks) {
          ++seed;
          std::vector<int> threads = {1, 2 + static_cast<int>(seed % 3)};
          check_case(M, N, K, 0, 0, seed % 2 == 0, threads, Values::kPlain, seed);
        }
    check_case(129, 200, 600, 0, 0, false, {1, 3}, Values::kPlain, 7);  // several row blocks and k blocks
  }

  TEST_CASE("strided and transposed views, accumulate on and off") {
    PathGuard guard;
    const int64_t shapes[][3] = {{33, 65, 17}, {64, 64, 300}, {9, 40, 1}, {130, 31, 70}};
    uint64_t seed = 5000;
    for (auto& s : shapes)
      for (int la = 0; la < 4; ++la)
        for (int lb = 0; lb < 4; ++lb)
          for (int acc = 0; acc < 2; ++acc)
            check_case(s[0], s[1], s[2], la, lb, acc == 1, {1, 3}, Values::kPlain, ++seed);
  }

  TEST_CASE("edge values: subnormals, signed zeros, infinities, NaN, rounding ties, the 2^-126 boundary") {
    PathGuard guard;
    uint64_t seed = 9000;
    const int64_t shapes[][3] = {{17, 33, 9}, {40, 70, 301}, {8, 32, 64}, {65, 17, 1}, {8, 32, 2}, {33, 33, 96}};
    for (auto& s : shapes)
      for (int acc = 0; acc < 2; ++acc)
        for (int la = 0; la < 2; ++la) {
          check_case(s[0], s[1], s[2], la, 1 - la, acc == 1, {1, 4}, Values::kSpecials, ++seed);
          check_case(s[0], s[1], s[2], la, 1 - la, acc == 1, {1}, Values::kBoundary, ++seed);
        }
  }

  TEST_CASE("directed cases (amx probe): separate E and O, tiny addends, flushing, signed zeros, overflow") {
    PathGuard guard;
    auto h = [](float x) { return ls::to_bf16(x); };
    const uint16_t one = h(1.0f), z = 0;
    struct Case {
      const char* what;
      std::vector<uint16_t> a, b;  // k = 0, 1, ...: even k to E, odd k to O
      float start;                 // accumulate from it
      uint32_t want;
    };
    const Case cases[] = {
        {"E = O = 2^-24 with C = 1: E + O first", {h(0x1p-24f), h(0x1p-24f)}, {one, one}, 1.0f,
         ls::bits(1.0f + 0x1p-23f)},
        {"a tiny addend joins a normal E unflushed", {h(0x1p-62f), z, h(0x1p-63f)}, {h(0x1p-63f), z, h(0x1p-64f)},
         0.0f, ls::bits(0x1.4p-125f)},
        {"two 2^-127 products (E, O) give 0", {h(0x1p-63f), h(0x1p-63f)}, {h(0x1p-64f), h(0x1p-64f)}, 0.0f, 0u},
        {"E = 2^-126, O = -2^-127: O flushed", {h(0x1p-63f), h(-0x1p-63f)}, {h(0x1p-63f), h(0x1p-64f)}, 0.0f,
         ls::bits(0x1p-126f)},
        {"a subnormal C counts as 0", {h(0x1p-63f)}, {h(0x1p-63f)}, ls::from_bits(0x00400000u), ls::bits(0x1p-126f)},
        {"tininess after rounding: 2^-126 - 2^-150 in E flushes (fma gives 2^-126)", {h(0x1p-63f), z, h(0x1p-75f)},
         {h(0x1p-63f), z, h(-0x1p-75f)}, 0.0f, 0u},
        {"all products -0 from -0: +0", {0x8000, 0x8000, 0x8000}, {one, one, one}, -0.0f, 0u},
        {"+2^254 in E, -2^254 in O: inf - inf, canonical NaN", {h(0x1p127f), h(0x1p127f)}, {h(0x1p127f), h(-0x1p127f)},
         0.0f, 0x7fc00000u},
        {"a NaN input: canonical NaN", {0x7fc5, one}, {one, one}, 0.0f, 0x7fc00000u},
    };
    for (const Case& c : cases) {
      const int64_t K = static_cast<int64_t>(c.a.size());
      float want = c.start;
      ls::ops::gemm_bf16_naive(1, 1, K, ConstMatBf16{c.a.data(), K, 1}, ConstMatBf16{c.b.data(), 1, 1}, &want, 1, true);
      INFO(c.what);
      CHECK(ls::bits(want) == c.want);
      // A 32 x 32 tile of the same dot product (the AMX kernel's full tile), and 1 x 1.
      const int64_t M = 32, N = 32;
      std::vector<uint16_t> a(M * K), b(K * N);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t k = 0; k < K; ++k) a[i * K + k] = c.a[k];
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < N; ++j) b[k * N + j] = c.b[k];
      for (Bf16Path p : paths_to_test()) {
        ls::ops::set_gemm_bf16_path(p);
        INFO("path=" << std::string(ls::ops::bf16_path_name(p)));
        std::vector<float> got(M * N, c.start);
        ls::ops::gemm_bf16(M, N, K, ConstMatBf16{a.data(), K, 1}, ConstMatBf16{b.data(), N, 1}, got.data(), N, true, 1);
        CHECK(ls::bits(got[0]) == c.want);
        CHECK(ls::bits(got[M * N - 1]) == c.want);
        float one_out = c.start;
        ls::ops::gemm_bf16(1, 1, K, ConstMatBf16{c.a.data(), K, 1}, ConstMatBf16{c.b.data(), 1, 1}, &one_out, 1, true,
                           1);
        CHECK(ls::bits(one_out) == c.want);
      }
    }
  }

  TEST_CASE("signed zeros: E, O and the fold start at +0; a -0 start with -0 products gives +0") {
    PathGuard guard;
    const int64_t M = 8, N = 32;
    std::vector<uint16_t> a(M * 65, 0x8000), b(65 * N, ls::to_bf16(1.0f));
    for (Bf16Path p : paths_to_test()) {
      ls::ops::set_gemm_bf16_path(p);
      INFO("path=" << std::string(ls::ops::bf16_path_name(p)));
      for (int64_t K : {1, 32, 40, 65}) {
        const ConstMatBf16 A{a.data(), K, 1}, B{b.data(), N, 1};
        std::vector<float> c(M * N, -0.0f);
        ls::ops::gemm_bf16(M, N, K, A, B, c.data(), N, false, 1);  // from +0
        CHECK(ls::bits(c[0]) == 0u);
        CHECK(ls::bits(c[M * N - 1]) == 0u);
        std::fill(c.begin(), c.end(), -0.0f);
        ls::ops::gemm_bf16(M, N, K, A, B, c.data(), N, true, 1);  // from -0: S = +0, +0 + -0 = +0
        CHECK(ls::bits(c[0]) == 0u);
        CHECK(ls::bits(c[M * N - 1]) == 0u);
      }
    }
  }

  TEST_CASE("K = 0 zeroes C or leaves it; empty M or N touch nothing") {
    PathGuard guard;
    const uint16_t a = 0x3f80, b = 0x3f80;
    std::vector<float> c(12, -3.0f);
    ls::ops::gemm_bf16(3, 3, 0, ConstMatBf16{&a, 1, 1}, ConstMatBf16{&b, 1, 1}, c.data(), 4, true);
    for (float x : c) CHECK(x == -3.0f);
    ls::ops::gemm_bf16(3, 3, 0, ConstMatBf16{&a, 1, 1}, ConstMatBf16{&b, 1, 1}, c.data(), 4, false);
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) CHECK(ls::bits(c[i * 4 + j]) == (j < 3 ? 0u : ls::bits(-3.0f)));
    ls::ops::gemm_bf16(0, 3, 5, ConstMatBf16{&a, 1, 1}, ConstMatBf16{&b, 1, 1}, c.data(), 4, false);
    ls::ops::gemm_bf16(3, 0, 5, ConstMatBf16{&a, 1, 1}, ConstMatBf16{&b, 1, 1}, c.data(), 4, false);
    CHECK(c[3] == -3.0f);
  }

  TEST_CASE("the fold is not the fp32 fma fold, nor vdpbf16ps's pair order, nor one accumulator") {
    PathGuard guard;
    // Hand case: products 2^-24, 2^-24 from 1. Folded one by one onto 1 (fp32,
    // or pairs as vdpbf16ps) each is a tie that rounds back to 1; E + O first
    // gives 2^-23, and 1 + 2^-23 is exact.
    const uint16_t a[2] = {ls::to_bf16(0x1p-24f), ls::to_bf16(0x1p-24f)}, ones[2] = {0x3f80, 0x3f80};
    float fp32[2] = {0x1p-24f, 0x1p-24f}, fones[2] = {1, 1}, c32 = 1.0f;
    ls::ops::gemm_naive(1, 1, 2, ls::ops::ConstMat{fp32, 2, 1}, ls::ops::ConstMat{fones, 1, 1}, &c32, 1, true);
    CHECK(c32 == 1.0f);
    for (Bf16Path p : paths_to_test()) {
      ls::ops::set_gemm_bf16_path(p);
      float c = 1.0f;
      ls::ops::gemm_bf16(1, 1, 2, ConstMatBf16{a, 2, 1}, ConstMatBf16{ones, 1, 1}, &c, 1, true, 1);
      CHECK(c == 1.0f + 0x1p-23f);
    }
    // Random data: the same bf16 values through the fp32 GEMM (ascending k),
    // vdpbf16ps's pair order (the odd member, then the even, on one
    // accumulator: the contract before AMX) and one flushed accumulator
    // ascending differ somewhere.
    ls::ops::set_gemm_bf16_path(Bf16Path::kAuto);
    const int64_t M = 16, N = 32, K = 256;
    View x = make_view(M, K, 0, 31, Values::kPlain), w = make_view(K, N, 0, 32, Values::kPlain);
    std::vector<float> xf(M * K), wf(K * N), got(M * N), asc(M * N);
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = ls::from_bf16(x.store[i]);
    for (size_t i = 0; i < wf.size(); ++i) wf[i] = ls::from_bf16(w.store[i]);
    ls::ops::gemm_bf16(M, N, K, x.m, w.m, got.data(), N, false, 2);
    ls::ops::gemm_naive(M, N, K, ls::ops::ConstMat{xf.data(), K, 1}, ls::ops::ConstMat{wf.data(), N, 1}, asc.data(), N,
                        false);
    int differ_asc = 0, differ_pairs = 0, differ_single = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        float pairs = 0.0f, single = 0.0f;
        for (int64_t k = 0; k < K; k += 2)
          for (int64_t kk : {k + 1, k}) pairs = ls::bf16_fold_step(pairs, xf[i * K + kk], wf[kk * N + j]);
        for (int64_t k = 0; k < K; ++k) single = ls::bf16_fold_step(single, xf[i * K + k], wf[k * N + j]);
        differ_pairs += ls::bits(pairs) != ls::bits(got[i * N + j]);
        differ_single += ls::bits(single) != ls::bits(got[i * N + j]);
        differ_asc += ls::bits(asc[i * N + j]) != ls::bits(got[i * N + j]);
      }
    CHECK(differ_asc > 0);
    CHECK(differ_pairs > 0);
    CHECK(differ_single > 0);
  }

  TEST_CASE("continuing a fold: equal to one fold after a multiple of 32 k, not after 2 or 40") {
    PathGuard guard;
    const int64_t M = 16, N = 32, K = 100;
    View a = make_view(M, K, 0, 51, Values::kPlain), b = make_view(K, N, 0, 52, Values::kPlain);
    for (Bf16Path p : paths_to_test()) {
      ls::ops::set_gemm_bf16_path(p);
      INFO("path=" << std::string(ls::ops::bf16_path_name(p)));
      std::vector<float> whole(M * N);
      ls::ops::gemm_bf16(M, N, K, a.m, b.m, whole.data(), N, false, 1);
      for (int64_t k1 : {32, 64, 2, 40}) {
        std::vector<float> split(M * N);
        ls::ops::gemm_bf16(M, N, k1, a.m, b.m, split.data(), N, false, 1);
        ls::ops::gemm_bf16(M, N, K - k1, ConstMatBf16{a.m.p + k1, K, 1}, ConstMatBf16{b.m.p + k1 * N, N, 1},
                           split.data(), N, true, 1);
        if (k1 % 32 == 0) {
          CHECK_SAME_BITS(split, whole);
        } else {
          CHECK(!lstest::bits_differ(split, whole).empty());
        }
      }
    }
  }

  TEST_CASE("the reference's plain loop equals the contract's fold") {
    const int64_t M = 13, N = 21;
    for (int64_t K : {37, 64, 70})
    for (Values kind : {Values::kPlain, Values::kSpecials, Values::kBoundary}) {
      View a = make_view(M, K, 0, 61, kind), b = make_view(K, N, 0, 62, kind);
      std::vector<float> want(M * N), got(M * N);
      ls::ops::gemm_bf16_naive(M, N, K, a.m, b.m, want.data(), N, false);
      ref::matmul_bf16(a.store.data(), b.store.data(), got.data(), M, N, K);
      CHECK_SAME_BITS(got, want);
    }
  }

  TEST_CASE("gemm_bf16_rounded: gemm_bf16's bits on the operands rounded first, every path, strided views") {
    PathGuard guard;
    uint64_t seed = 77000;
    const int64_t shapes[][3] = {{33, 65, 17}, {64, 64, 300}, {9, 40, 1}, {130, 31, 70}, {8, 32, 600}};
    for (auto& sh : shapes)
      for (int transposed = 0; transposed < 2; ++transposed)
        for (int acc = 0; acc < 2; ++acc) {
          const int64_t M = sh[0], N = sh[1], K = sh[2];
          ++seed;
          // fp32 operands: exact ties, subnormals, ordinary values (no inf or NaN: see the edge-value case).
          std::vector<float> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(K * N));
          fill_fp32(a, seed);
          fill_fp32(b, seed + 500);
          std::vector<uint16_t> a16(a.size()), b16(b.size());
          for (size_t i = 0; i < a.size(); ++i) a16[i] = ls::to_bf16(a[i]);
          for (size_t i = 0; i < b.size(); ++i) b16[i] = ls::to_bf16(b[i]);
          // A as stored or transposed (K x M, read with swapped strides).
          const int64_t ars = transposed ? 1 : K, acs = transposed ? M : 1;
          std::vector<float> at(a.size());
          std::vector<uint16_t> at16(a.size());
          for (int64_t i = 0; i < M; ++i)
            for (int64_t k = 0; k < K; ++k) {
              at[static_cast<size_t>(i * ars + k * acs)] = a[static_cast<size_t>(i * K + k)];
              at16[static_cast<size_t>(i * ars + k * acs)] = a16[static_cast<size_t>(i * K + k)];
            }
          std::vector<float> c0(static_cast<size_t>(M * N), 0.25f);
          std::vector<float> want = c0;
          ls::ops::gemm_bf16_naive(M, N, K, ConstMatBf16{at16.data(), ars, acs}, ConstMatBf16{b16.data(), N, 1},
                                   want.data(), N, acc == 1);
          for (Bf16Path p : paths_to_test()) {
            ls::ops::set_gemm_bf16_path(p);
            for (int t : {1, 3}) {
              std::vector<float> got = c0;
              ls::ops::gemm_bf16_rounded(M, N, K, ls::ops::ConstMat{at.data(), ars, acs},
                                         ls::ops::ConstMat{b.data(), N, 1}, got.data(), N, acc == 1, t);
              INFO("M=" << M << " N=" << N << " K=" << K << " transposed=" << transposed << " threads=" << t
                        << " path=" << ls::ops::bf16_path_name(ls::ops::gemm_bf16_path()));
              CHECK_SAME_BITS(got, want);
            }
          }
        }
  }

  TEST_CASE("weight_grad_bf16: a bf16 fold per leaf from the leaf's first row, the leaf tree; every path and thread count") {
    PathGuard guard;
    // Leaves of 0, 1, 31, 32, 33 and 70 rows: blocks start at each leaf's first row, the last padded.
    const std::vector<int64_t> off = {0, 0, 1, 32, 64, 97, 97, 167, 168};
    const int64_t leaves = (int64_t)off.size() - 1, rows = off.back();
    const int shapes[][2] = {{13, 37}, {32, 32}, {64, 96}, {70, 33}};
    uint64_t seed = 91000;
    for (auto& sh : shapes) {
      const int in = sh[0], out = sh[1], ldx = in + 3, ldy = out + 5;  // rows of wider tensors
      std::vector<float> X(static_cast<size_t>(rows * ldx)), dY(static_cast<size_t>(rows * ldy));
      fill_fp32(X, ++seed, true);
      fill_fp32(dY, ++seed, true);
      std::vector<float> want(static_cast<size_t>(in * out));
      ls::ops::weight_grad_bf16_naive(X.data(), ldx, dY.data(), ldy, in, out, off.data(), leaves, want.data());
      // Not the fp32 fold over the rounded operands (the rule before the bf16 fold went over tokens).
      std::vector<float> fma_fold(want.size());
      for (int i = 0; i < in; ++i)
        for (int j = 0; j < out; ++j) {
          std::vector<float> part(static_cast<size_t>(leaves));
          for (int64_t l = 0; l < leaves; ++l) {
            float acc = 0.0f;
            for (int64_t n = off[l]; n < off[l + 1]; ++n)
              acc = ls::fma(ls::from_bf16(ls::to_bf16(X[n * ldx + i])), ls::from_bf16(ls::to_bf16(dY[n * ldy + j])), acc);
            part[static_cast<size_t>(l)] = acc;
          }
          fma_fold[static_cast<size_t>(i * out + j)] = ls::tree_sum(part.data(), leaves);
        }
      CHECK(std::memcmp(fma_fold.data(), want.data(), sizeof(float) * want.size()) != 0);
      for (Bf16Path p : paths_to_test()) {
        ls::ops::set_gemm_bf16_path(p);
        for (int t : {1, 2}) {
          omp_set_num_threads(t);
          std::vector<float> got(want.size(), 9.0f);
          ls::ops::weight_grad_bf16(X.data(), ldx, dY.data(), ldy, in, out, off.data(), leaves, got.data());
          INFO("in=" << in << " out=" << out << " threads=" << t << " path=" << std::string(ls::ops::bf16_path_name(p)));
          CHECK_SAME_BITS(got, want);
        }
      }
      omp_set_num_threads(1);
    }
  }

  TEST_CASE("avx512-bf16: vdpbf16ps gives the fold's bits on edge values down to the limit, and hands smaller ones on") {
    // The path's precondition (gemm_bf16.h): the smallest nonzero exponents of A and B sum to -135 or more.
    // Within it, the edge values (+-0, +-inf, NaN, huge values whose products overflow, small magnitudes
    // whose products and sums land below 2^-126 and flush) must run on vdpbf16ps itself and give
    // ls::bf16_dot's bits: with both operands' smallest exponents at -62, and at the limit, A's at -100
    // and B's at -35. Past the limit the call runs on avx512, with the same bits.
    if (!ls::ops::gemm_bf16_path_supported(Bf16Path::kAvx512Bf16)) {
      MESSAGE("CPU lacks avx512-bf16: that path is not tested here");
      return;
    }
    PathGuard guard;
    ls::ops::set_gemm_bf16_path(Bf16Path::kAvx512Bf16);
    const int64_t M = 19, N = 45, K = 150;
    for (const auto& [a_lo, b_lo] : {std::pair{-62, -62}, std::pair{-100, -35}}) {
      CAPTURE(a_lo);
      uint64_t x = 99;
      auto value = [&](int lo) -> uint16_t {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t r = static_cast<uint32_t>(x >> 33);
        const uint16_t sign = (r & 1) ? 0x8000 : 0, mant = (r >> 1) & 0x7f;
        switch (r % 16) {
          case 0: return sign;                           // +-0
          case 1: return sign | 0x7f80;                  // +-inf
          case 2: return 0x7fc0 | mant;                  // NaN
          case 3: return sign | (uint16_t)((127 + 60) << 7) | mant;  // products overflow
          default: {
            // magnitudes 2^lo .. 2^(lo+6) (products near the limit: sums cancel below 2^-126), or ordinary ones
            const int e = (r % 16) < 12 ? 127 + lo + (int)(r >> 8) % 7 : 127 - 3 + (int)(r >> 8) % 6;
            return sign | (uint16_t)(e << 7) | mant;
          }
        }
      };
      std::vector<uint16_t> a((size_t)(M * K)), b((size_t)(K * N));
      for (auto& v : a) v = value(a_lo);
      for (auto& v : b) v = value(b_lo);
      // The first rows of A and columns of B: magnitudes 2^lo .. 2^(lo+5) only, so their products are tiny.
      for (int64_t i = 0; i < M / 2; ++i)
        for (int64_t k = 0; k < K; ++k)
          a[(size_t)(i * K + k)] = (uint16_t)((a[(size_t)(i * K + k)] & 0x8000) | ((127 + a_lo + k % 6) << 7) | (k * 37 & 0x7f));
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < N / 2; ++j)
          b[(size_t)(k * N + j)] = (uint16_t)((b[(size_t)(k * N + j)] & 0x8000) | ((127 + b_lo + j % 6) << 7) | (j * 11 + k & 0x7f));
      const ls::ops::ConstMatBf16 A{a.data(), K, 1}, B{b.data(), N, 1};
      std::vector<float> want((size_t)(M * N)), got(want.size());
      ls::ops::gemm_bf16_naive(M, N, K, A, B, want.data(), N, false);
      const int64_t before = ls::ops::gemm_bf16_tiny_fallbacks();
      const unsigned csr = _mm_getcsr();  // the path's FTZ scope leaves MXCSR as it found it
      ls::ops::gemm_bf16(M, N, K, A, B, got.data(), N, false, 1);
      CHECK(_mm_getcsr() == csr);
      CHECK(ls::ops::gemm_bf16_tiny_fallbacks() == before);  // vdpbf16ps ran it
      CHECK_SAME_BITS(got, want);
      int64_t tiny = 0;  // outputs of tiny products only: their steps pass below 2^-126, where flushing acts
      for (float f : want) tiny += f != 0.0f && std::fabs(f) < 0x1p-110f;
      CHECK(tiny > 0);
      // A product with bits below 2^-149 (a value 20 binades below A's smallest): the call runs on avx512,
      // the same bits.
      a[5] = (uint16_t)((127 + a_lo - 20) << 7);
      ls::ops::gemm_bf16_naive(M, N, K, A, B, want.data(), N, false);
      ls::ops::gemm_bf16(M, N, K, A, B, got.data(), N, false, 1);
      CHECK(_mm_getcsr() == csr);  // and around the tiles it replayed
      CHECK(ls::ops::gemm_bf16_tiny_fallbacks() == before + 1);
      CHECK_SAME_BITS(got, want);
    }
  }

  TEST_CASE("avx512-bf16: the check for products below 2^-149 finds a small value wherever it lies") {
    // The check reads 16 or 32 values at a time along the stride-1 side and
    // the rest one by one. With every other value 2^-20, a value whose
    // exponent is below -115 (the exponents sum below -135) in the vector
    // body, in the tail, in A or in B, row-major or transposed, stored bf16
    // or fp32, must send the call to avx512 (one fallback); one at -115 must
    // not, nor a subnormal (the fold reads it as zero), unless it is an fp32
    // value that rounds up to bf16's 2^-126: values are judged as packed.
    if (!ls::ops::gemm_bf16_path_supported(Bf16Path::kAvx512Bf16)) {
      MESSAGE("CPU lacks avx512-bf16: that path is not tested here");
      return;
    }
    PathGuard guard;
    ls::ops::set_gemm_bf16_path(Bf16Path::kAvx512Bf16);
    const int64_t M = 7, N = 37, K = 70;  // 70 = 2 x 32 + 6 and 4 x 16 + 6: body and tail
    const uint16_t small = (uint16_t)((127 - 20) << 7);
    std::vector<float> c((size_t)(M * N));
    for (bool transposed : {false, true}) {
      // A is M x K and B is K x N; transposed: stored column-major (stride 1 along the other side).
      const int64_t ars = transposed ? 1 : K, acs = transposed ? M : 1, brs = transposed ? 1 : N, bcs = transposed ? K : 1;
      for (int64_t at : {int64_t(0), int64_t(17), int64_t(33), int64_t(M * K - 1), int64_t(M * K + 40)}) {
        std::vector<uint16_t> a((size_t)(M * K), small), b((size_t)(K * N), small);
        std::vector<float> af((size_t)(M * K), 0x1p-20f), bf((size_t)(K * N), 0x1p-20f);
        const bool in_a = at < M * K;
        const size_t i = (size_t)(in_a ? at : at - M * K);
        const ls::ops::ConstMatBf16 A{a.data(), ars, acs}, B{b.data(), brs, bcs};
        const ls::ops::ConstMat Af{af.data(), ars, acs}, Bf{bf.data(), brs, bcs};
        auto fallbacks = [&](auto run) {
          const int64_t before = ls::ops::gemm_bf16_tiny_fallbacks();
          run();
          return ls::ops::gemm_bf16_tiny_fallbacks() - before;
        };
        auto bf16_run = [&] { ls::ops::gemm_bf16(M, N, K, A, B, c.data(), N, false, 1); };
        auto fp32_run = [&] { ls::ops::gemm_bf16_rounded(M, N, K, Af, Bf, c.data(), N, false, 1); };
        CAPTURE(transposed);
        CAPTURE(at);
        CHECK(fallbacks(bf16_run) == 0);
        CHECK(fallbacks(fp32_run) == 0);
        (in_a ? a : b)[i] = (uint16_t)(0x8000 | (127 - 116) << 7 | 0x7f);  // -1.99 x 2^-116
        (in_a ? af : bf)[i] = -0x1.fp-116f;
        CHECK(fallbacks(bf16_run) == 1);
        CHECK(fallbacks(fp32_run) == 1);
        (in_a ? a : b)[i] = (uint16_t)((127 - 115) << 7);  // 2^-115: at the limit
        (in_a ? af : bf)[i] = 0x1p-115f;
        CHECK(fallbacks(bf16_run) == 0);
        CHECK(fallbacks(fp32_run) == 0);
        (in_a ? a : b)[i] = (uint16_t)0x0041;  // a bf16 subnormal: read as zero
        CHECK(fallbacks(bf16_run) == 0);
        (in_a ? af : bf)[i] = 0x1p-140f;  // an fp32 subnormal: a bf16 subnormal, read as zero
        CHECK(fallbacks(fp32_run) == 0);
        (in_a ? af : bf)[i] = 0x1.fffffcp-127f;  // rounds up to 2^-126: -146 with the other's -20
        CHECK(fallbacks(fp32_run) == 1);
      }
    }
  }

  TEST_CASE("LeafFold at bf16 fed in pieces of any size equals one weight_grad_bf16: the open block waits") {
    PathGuard guard;
    ls::precision_slot().store(static_cast<int>(ls::Precision::kBf16));
    struct Restore {
      ~Restore() { ls::precision_slot().store(static_cast<int>(ls::Precision::kFp32)); }
    } restore;
    const int in = 40, out = 33;
    const std::vector<int64_t> cuts = {0, 0, 7, 45, 110, 110, 111, 150};  // leaves 0 and 4 empty
    const int64_t leaves = (int64_t)cuts.size() - 1, rows = cuts.back();
    std::vector<int64_t> leaf(static_cast<size_t>(rows));
    for (int64_t lf = 0; lf < leaves; ++lf)
      for (int64_t r = cuts[lf]; r < cuts[lf + 1]; ++r) leaf[r] = lf;
    std::vector<float> X(static_cast<size_t>(rows * in)), dY(static_cast<size_t>(rows * out));
    fill_fp32(X, 5, true);
    fill_fp32(dY, 6, true);
    std::vector<float> want(static_cast<size_t>(in * out));
    ls::ops::weight_grad_bf16_naive(X.data(), in, dY.data(), out, in, out, cuts.data(), leaves, want.data());
    for (Bf16Path p : paths_to_test()) {
      ls::ops::set_gemm_bf16_path(p);
      for (int64_t piece : {1, 5, 31, 32, 33, 64, 150}) {
        INFO("piece=" << piece << " path=" << std::string(ls::ops::bf16_path_name(p)));
        ls::ops::DeviceVector<float> state;
        std::vector<float> got(want.size(), 7.0f);
        ls::ops::LeafFold fold;
        fold.begin(in, out, leaves, &state);
        for (int64_t r = 0; r < rows; r += piece)
          fold.add(&X[r * in], in, &dY[r * out], out, &leaf[r], std::min(piece, rows - r));
        fold.finish(got.data());
        CHECK_SAME_BITS(got, want);
      }
    }
  }
}
