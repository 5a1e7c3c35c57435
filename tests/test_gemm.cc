// The contract GEMM must equal the plain fma triple loop bit for bit, on
// every instruction-set path, thread count, shape, stride and input class.
#include <doctest/doctest.h>
#include <omp.h>
#include <string.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "bits.h"
#include "numerics/contract.h"
#include "ops/gemm.h"

using ls::ops::ConstMat;
using ls::ops::GemmPath;

namespace {

// Restores kAuto when a test case ends, whatever it forced.
struct PathGuard {
  ~PathGuard() { ls::ops::set_gemm_path(GemmPath::kAuto); }
};

std::vector<GemmPath> paths_to_test() {
  std::vector<GemmPath> out = {GemmPath::kScalar};
  if (ls::ops::gemm_path_supported(GemmPath::kAvx2)) out.push_back(GemmPath::kAvx2);
  if (ls::ops::gemm_path_supported(GemmPath::kAvx512)) {
    out.push_back(GemmPath::kAvx512);
  } else {
    MESSAGE("CPU lacks AVX-512: the avx512 path is not tested here");
  }
  return out;
}

// Values in [-1, 1); with `specials`, one in four is a subnormal, a signed
// zero or an infinity (never a NaN input: NaN payload choice is not part of
// the contract, the only NaNs are the default ones inf*0 and inf-inf make).
void fill(std::vector<float>& v, uint64_t seed, bool specials) {
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = ls::random_symmetric(seed, ls::Purpose::kTest, i, 1.0f);
    if (!specials) continue;
    uint32_t u = ls::random_u32(seed + 1000, ls::Purpose::kTest, i);
    switch (u % 16) {
      case 0: v[i] = ls::from_bits(1 + (u >> 9)); break;                // +subnormal
      case 1: v[i] = ls::from_bits(0x80000000u | (1 + (u >> 9))); break;  // -subnormal
      case 2: v[i] = -0.0f; break;
      case 3: v[i] = 0.0f; break;
      case 4: v[i] = (u >> 8) % 64 == 0 ? std::numeric_limits<float>::infinity() : 1e-38f; break;
      case 5: v[i] = (u >> 8) % 64 == 0 ? -std::numeric_limits<float>::infinity() : -1e-39f; break;
      default: break;
    }
  }
}

// A stored with row stride / column stride chosen by layout:
// 0 row-major, 1 transposed (column-major), 2 padded rows, 3 neither stride 1.
struct View {
  std::vector<float> store;
  ConstMat m;
};
View make_view(int64_t rows, int64_t cols, int layout, uint64_t seed, bool specials) {
  View v;
  int64_t rs = cols, cs = 1, size = rows * cols;
  if (layout == 1) { rs = 1; cs = rows; }
  if (layout == 2) { rs = cols + 3; cs = 1; size = rows * rs; }
  if (layout == 3) { rs = 2; cs = 2 * rows + 1; size = cols * cs + 2; }
  v.store.assign(static_cast<size_t>(std::max<int64_t>(size, 1)), 0.0f);
  fill(v.store, seed, specials);
  v.m = ConstMat{v.store.data(), rs, cs};
  return v;
}

// Runs gemm on every path with the given thread counts and checks each
// result against gemm_naive on the same initial C.
void check_case(int64_t M, int64_t N, int64_t K, int la, int lb, bool accumulate,
                const std::vector<int>& threads, bool specials, uint64_t seed) {
  View a = make_view(M, K, la, seed, specials);
  View b = make_view(K, N, lb, seed + 1, specials);
  const int64_t ldc = N + (seed % 3 == 0 ? 5 : 0);
  std::vector<float> c0(static_cast<size_t>(std::max<int64_t>(M * ldc, 1)));
  fill(c0, seed + 2, specials);
  std::vector<float> want = c0;
  ls::ops::gemm_naive(M, N, K, a.m, b.m, want.data(), ldc, accumulate);
  for (GemmPath p : paths_to_test()) {
    ls::ops::set_gemm_path(p);
    for (int t : threads) {
      std::vector<float> got = c0;
      ls::ops::gemm(M, N, K, a.m, b.m, got.data(), ldc, accumulate, t);
      INFO("M=" << M << " N=" << N << " K=" << K << " layoutA=" << la << " layoutB=" << lb
                << " acc=" << accumulate << " threads=" << t
                << " path=" << ls::ops::gemm_path_name());
      CHECK_SAME_BITS(got, want);
    }
  }
}

}  // namespace

TEST_SUITE("gemm") {
  TEST_CASE("paths: forcing selects the path, kAuto picks the best supported") {
    PathGuard guard;
    ls::ops::set_gemm_path(GemmPath::kScalar);
    CHECK(std::string(ls::ops::gemm_path_name()) == "scalar");
    ls::ops::set_gemm_path(GemmPath::kAvx2);
    CHECK(std::string(ls::ops::gemm_path_name()) ==
          (ls::ops::gemm_path_supported(GemmPath::kAvx2) ? "avx2" : "scalar"));
    ls::ops::set_gemm_path(GemmPath::kAuto);
    if (ls::ops::gemm_path_supported(GemmPath::kAvx512)) {
      CHECK(std::string(ls::ops::gemm_path_name()) == "avx512");
    } else {
      MESSAGE("CPU lacks AVX-512; kAuto is " << ls::ops::gemm_path_name());
    }
  }

  TEST_CASE("naive is the sequential fma fold over k from C or +0") {
    const float a[3] = {1.5f, -2.0f, 0.25f}, b[3] = {3.0f, 0.5f, -8.0f};
    float c = 10.0f;
    ls::ops::gemm_naive(1, 1, 3, ConstMat{a, 3, 1}, ConstMat{b, 1, 1}, &c, 1, true);
    float want = ls::fma(0.25f, -8.0f, ls::fma(-2.0f, 0.5f, ls::fma(1.5f, 3.0f, 10.0f)));
    CHECK(ls::bits(c) == ls::bits(want));
    // Start is +0, not C: (-0)*(+1) added to +0 gives +0.
    const float nz = -0.0f, one = 1.0f;
    c = 5.0f;
    ls::ops::gemm_naive(1, 1, 1, ConstMat{&nz, 1, 1}, ConstMat{&one, 1, 1}, &c, 1, false);
    CHECK(ls::bits(c) == 0u);
  }

  TEST_CASE("shapes sweep: every path and thread count equals naive bitwise") {
    PathGuard guard;
    const int64_t dims[] = {1, 7, 17, 31, 33, 63, 65, 129};
    const int64_t ks[] = {0, 1, 5, 64, 257, 520};
    uint64_t seed = 100;
    for (int64_t M : dims)
      for (int64_t N : dims)
        for (int64_t K : ks) {
          ++seed;
          // Thread counts rotate across shapes; 1 always included.
          std::vector<int> threads = {1, 2 + static_cast<int>(seed % 3)};
          check_case(M, N, K, 0, 0, seed % 2 == 0, threads, false, seed);
        }
  }

  TEST_CASE("strided and transposed views, accumulate on and off") {
    PathGuard guard;
    const int64_t shapes[][3] = {{33, 65, 17}, {64, 64, 300}, {9, 40, 1}, {130, 31, 70}};
    uint64_t seed = 5000;
    for (auto& s : shapes)
      for (int la = 0; la < 4; ++la)
        for (int lb = 0; lb < 4; ++lb)
          for (int acc = 0; acc < 2; ++acc)
            check_case(s[0], s[1], s[2], la, lb, acc == 1, {1, 3}, false, ++seed);
  }

  TEST_CASE("engine shapes: X·W, dY·Wᵀ, Xᵀ·dY") {
    PathGuard guard;
    // M x K x N with A row-major, B row-major (X·W); B transposed (dY·Wᵀ);
    // A transposed (Xᵀ·dY over a 64-token leaf).
    check_case(1024, 192, 64, 0, 0, false, {1, 2}, false, 1);
    check_case(256, 64, 128, 0, 1, false, {1, 4}, false, 2);
    check_case(64, 64, 1024, 1, 0, true, {1, 2}, false, 3);
  }

  TEST_CASE("special inputs: subnormals, signed zeros, infinities") {
    PathGuard guard;
    uint64_t seed = 9000;
    const int64_t shapes[][3] = {{17, 33, 9}, {40, 70, 300}, {8, 32, 64}, {65, 17, 1}};
    for (auto& s : shapes)
      for (int acc = 0; acc < 2; ++acc)
        for (int la = 0; la < 2; ++la)
          check_case(s[0], s[1], s[2], la, 1 - la, acc == 1, {1, 4}, true, ++seed);
    // All-signed-zero products: the fold from +0 gives +0, from C = -0 gives -0.
    PathGuard g2;
    std::vector<float> a(8 * 40, -0.0f), b(40 * 32, 1.0f);
    for (GemmPath p : paths_to_test()) {
      ls::ops::set_gemm_path(p);
      std::vector<float> c(8 * 32, -0.0f);
      ls::ops::gemm(8, 32, 40, ConstMat{a.data(), 40, 1}, ConstMat{b.data(), 32, 1}, c.data(),
                    32, false, 1);
      CHECK(ls::bits(c[0]) == 0u);
      CHECK(ls::bits(c[8 * 32 - 1]) == 0u);
      std::fill(c.begin(), c.end(), -0.0f);
      ls::ops::gemm(8, 32, 40, ConstMat{a.data(), 40, 1}, ConstMat{b.data(), 32, 1}, c.data(),
                    32, true, 1);
      CHECK(ls::bits(c[0]) == 0x80000000u);
    }
  }

  TEST_CASE("K = 0 zeroes C or leaves it; empty M or N touch nothing") {
    PathGuard guard;
    float a = 1.0f, b = 1.0f;
    std::vector<float> c(12, -3.0f);
    ls::ops::gemm(3, 3, 0, ConstMat{&a, 1, 1}, ConstMat{&b, 1, 1}, c.data(), 4, true);
    for (float x : c) CHECK(x == -3.0f);
    ls::ops::gemm(3, 3, 0, ConstMat{&a, 1, 1}, ConstMat{&b, 1, 1}, c.data(), 4, false);
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) CHECK(ls::bits(c[i * 4 + j]) == (j < 3 ? 0u : ls::bits(-3.0f)));
    ls::ops::gemm(0, 3, 5, ConstMat{&a, 1, 1}, ConstMat{&b, 1, 1}, c.data(), 4, false);
    ls::ops::gemm(3, 0, 5, ConstMat{&a, 1, 1}, ConstMat{&b, 1, 1}, c.data(), 4, false);
    CHECK(c[3] == -3.0f);
  }

  TEST_CASE("inside an OpenMP region threads = 0 means one thread per call") {
    PathGuard guard;
    const int64_t M = 70, N = 50, K = 90;
    View a = make_view(M, K, 0, 77, false), b = make_view(K, N, 0, 78, false);
    std::vector<float> want(M * N);
    ls::ops::gemm_naive(M, N, K, a.m, b.m, want.data(), N, false);
    std::vector<std::vector<float>> got(4, std::vector<float>(M * N));
#pragma omp parallel for num_threads(4)
    for (int t = 0; t < 4; ++t) ls::ops::gemm(M, N, K, a.m, b.m, got[t].data(), N, false);
    for (int t = 0; t < 4; ++t) CHECK_SAME_BITS(got[t], want);
  }

  TEST_CASE("order matters: the test can tell the fold from a blocked sum") {
    // Sequential: ((1 + 1e8) - 1e8) + 1 = 1; pairwise (1 + 1e8) + (-1e8 + 1) = 0.
    const float a[4] = {1.0f, 1e8f, -1e8f, 1.0f}, b[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    float c = 0.0f;
    ls::ops::gemm(1, 1, 4, ConstMat{a, 4, 1}, ConstMat{b, 1, 1}, &c, 1, false, 1);
    CHECK(c == 1.0f);
    CHECK(((a[0] + a[1]) + (a[2] + a[3])) == 0.0f);
    // Random data: gemm equals naive yet differs from a k-blocked (two
    // halves, then added) sum somewhere, so a k-split would be caught.
    const int64_t M = 16, N = 32, K = 512;
    View x = make_view(M, K, 0, 31, false), w = make_view(K, N, 0, 32, false);
    std::vector<float> got(M * N), want(M * N), blocked(M * N);
    ls::ops::gemm(M, N, K, x.m, w.m, got.data(), N, false, 2);
    ls::ops::gemm_naive(M, N, K, x.m, w.m, want.data(), N, false);
    CHECK_SAME_BITS(got, want);
    int differ = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        float lo = 0.0f, hi = 0.0f;
        for (int64_t k = 0; k < K / 2; ++k) lo = ls::fma(x.m.p[i * K + k], w.m.p[k * N + j], lo);
        for (int64_t k = K / 2; k < K; ++k) hi = ls::fma(x.m.p[i * K + k], w.m.p[k * N + j], hi);
        blocked[i * N + j] = lo + hi;
        differ += ls::bits(blocked[i * N + j]) != ls::bits(got[i * N + j]);
      }
    CHECK(differ > 0);
  }
}
