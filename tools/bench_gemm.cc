// lockstep-bench-gemm: the contract GEMM against Eigen and against the
// machine's measured fp32 FMA peak, side by side in one run, and the
// machine's bf16 matrix peak (AMX TDPBF16PS, else AVX512-BF16) for the MFU
// of bf16 runs. --bf16: the contract's bf16 GEMM (the best path, then each
// path) against the fp32 one at one thread.
//
//   lockstep-bench-gemm [--quick] [--bf16]
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "numerics/contract.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace {

using Clock = std::chrono::steady_clock;
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Calls of f that fill about min_s seconds (after one warm-up call that
// also warms caches, pack buffers and thread pools).
template <class F>
int calls_for(double min_s, F&& f) {
  f();
  auto t0 = Clock::now();
  f();
  return std::max(1, static_cast<int>(min_s / std::max(seconds_since(t0), 1e-7)));
}
template <class F>
double time_calls(int calls, F&& f) {
  auto t0 = Clock::now();
  for (int c = 0; c < calls; ++c) f();
  return seconds_since(t0) / calls;
}

// Best-of-`reps` rates of f and g in GFLOP/s, their reps interleaved so that
// load from other processes hits both alike.
template <class F, class G>
std::pair<double, double> best_pair(double flops, double min_s, int reps, F&& f, G&& g) {
  const int cf = calls_for(min_s, f), cg = calls_for(min_s, g);
  double bf = 1e30, bg = 1e30;
  for (int r = 0; r < reps; ++r) {
    bf = std::min(bf, time_calls(cf, f));
    bg = std::min(bg, time_calls(cg, g));
  }
  return {flops / bf * 1e-9, flops / bg * 1e-9};
}

template <class F>
double best_gflops(double flops, double min_s, int reps, F&& f) {
  return best_pair(flops, min_s, reps, f, [] {}).first;
}

// Peak fp32 FMA rate of one thread: 12 independent 16-lane fma chains
// (enough to cover latency x throughput on current cores).
__attribute__((target("avx512f"), noinline)) float fma_loop_avx512(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((noinline)) float fma_loop_avx2(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  float out[8];
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  _mm256_storeu_ps(out, s);
  return out[0];
}

volatile float g_sink;

// Peak bf16 rate of one thread on AMX: TDPBF16PS into 4 independent C tiles
// (16 x 16 fp32 each, 16 x 32 bf16 A and B tiles: 16384 flops per op).
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  uint8_t reserved2[16] = {};
};
__attribute__((target("amx-tile,amx-bf16"), noinline)) void amx_loop(int64_t iters) {
  static const AmxConfig config;
  alignas(64) static uint16_t ones[16 * 32];
  for (uint16_t& x : ones) x = 0x3f80;  // 1.0: the sums stay far from overflow (32 per op and element)
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_release();
}
// Without AMX, AVX512-BF16: 12 independent VDPBF16PS chains (64 flops each).
__attribute__((target("avx512f,avx512bf16"), noinline)) float dpbf16_loop(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
  for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// The machine's bf16 matrix peak at `threads` threads, GFLOP/s, and the
// instruction measured; 0 where the CPU has neither.
double bf16_peak_gflops(int threads, double min_s, const char** what) {
  const bool amx = ls::ops::gemm_bf16_path_supported(ls::ops::Bf16Path::kAmx);  // also asks the OS for the tiles
  const bool dp = __builtin_cpu_supports("avx512bf16");
  *what = amx ? "AMX TDPBF16PS" : dp ? "AVX512-BF16 VDPBF16PS" : "none";
  if (!amx && !dp) return 0;
  const int64_t iters = amx ? 1 << 16 : 1 << 22;
  const double flops_per_thread = amx ? (double)iters * 4 * 16384 : (double)iters * 12 * 64;
  const double g = best_gflops(flops_per_thread * threads, min_s, 3, [&] {
#pragma omp parallel num_threads(threads)
    {
      if (amx) {
        amx_loop(iters);
      } else {
        float r = dpbf16_loop(iters);
        if (r == 12345.0f) g_sink = r;
      }
    }
  });
  if (amx) ls::ops::internal::amx_tiles_clobbered();  // the contract's amx path reloads its tiles
  return g;
}

double peak_gflops(int threads, bool avx512, double min_s) {
  const int64_t iters = 1 << 22;
  const double flops_per_thread = static_cast<double>(iters) * 12 * (avx512 ? 16 : 8) * 2;
  return best_gflops(flops_per_thread * threads, min_s, 3, [&] {
#pragma omp parallel num_threads(threads)
    {
      float r = avx512 ? fma_loop_avx512(iters) : fma_loop_avx2(iters);
      if (r == 12345.0f) g_sink = r;
    }
  });
}

struct Shape {
  int64_t m, k, n;
  bool square;
};

// --bf16: the bf16 GEMM on each path beside the fp32 contract GEMM, square
// shapes, one thread, row-major operands, fp32 peak measured now.
int bench_bf16(double min_s, int reps) {
  using ls::ops::Bf16Path;
  const bool avx512 = ls::ops::gemm_path_supported(ls::ops::GemmPath::kAvx512);
  const double fma_peak = peak_gflops(1, avx512, min_s);
  printf("lockstep-bench-gemm --bf16  fp32 path=%s  bf16 path=%s  1 thread\n", ls::ops::gemm_path_name(),
         ls::ops::bf16_path_name(ls::ops::gemm_bf16_path()));
  const char* what = "";
  const double bf16_peak = bf16_peak_gflops(1, min_s, &what);
  printf("peak: fp32 FMA %.1f GFLOP/s, bf16 %.1f GFLOP/s (%s)\n\n", fma_peak, bf16_peak, what);
  printf("%-16s  %10s  %10s  %7s  %8s\n", "shape MxKxN", "fp32", "bf16", "bf16/", "fp32");
  printf("%-16s  %10s  %10s  %7s  %8s\n", "", "GFLOP/s", "GFLOP/s", "fp32", "%fmapk");
  for (int64_t n : {256, 384, 512, 768, 1024}) {
    std::vector<float> af(n * n), bf(n * n), c(n * n);
    std::vector<uint16_t> ah(n * n), bh(n * n);
    for (int64_t i = 0; i < n * n; ++i) {
      af[i] = ls::from_bf16(ah[i] = ls::to_bf16(ls::random_symmetric(1, ls::Purpose::kTest, i, 1.0f)));
      bf[i] = ls::from_bf16(bh[i] = ls::to_bf16(ls::random_symmetric(2, ls::Purpose::kTest, i, 1.0f)));
    }
    auto [g32, g16] = best_pair(
        2.0 * n * n * n, min_s, reps,
        [&] { ls::ops::gemm(n, n, n, {af.data(), n, 1}, {bf.data(), n, 1}, c.data(), n, false, 1); },
        [&] { ls::ops::gemm_bf16(n, n, n, {ah.data(), n, 1}, {bh.data(), n, 1}, c.data(), n, false, 1); });
    std::string name = std::to_string(n) + "x" + std::to_string(n) + "x" + std::to_string(n);
    printf("%-16s  %10.1f  %10.1f  %7.2f  %7.1f%%\n", name.c_str(), g32, g16, g16 / g32, 100.0 * g32 / fma_peak);
    fflush(stdout);
  }
  // Every path (same bits), for reference.
  const int64_t n = 512;
  std::vector<uint16_t> ah(n * n, 0x3f80), bh(n * n, 0x3c00);
  std::vector<float> c(n * n);
  printf("\nbf16 paths, 512x512x512, 1 thread:");
  for (Bf16Path p : {Bf16Path::kAmx, Bf16Path::kAvx512Bf16, Bf16Path::kAvx512, Bf16Path::kAvx2, Bf16Path::kScalar}) {
    if (!ls::ops::gemm_bf16_path_supported(p)) continue;
    ls::ops::set_gemm_bf16_path(p);
    double g = best_gflops(2.0 * n * n * n, min_s, 2, [&] {
      ls::ops::gemm_bf16(n, n, n, {ah.data(), n, 1}, {bh.data(), n, 1}, c.data(), n, false, 1);
    });
    printf("  %s %.1f GFLOP/s", ls::ops::bf16_path_name(p), g);
  }
  ls::ops::set_gemm_bf16_path(Bf16Path::kAuto);
  printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, bf16 = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!strcmp(argv[i], "--bf16")) {
      bf16 = true;
    } else {
      fprintf(stderr, "usage: %s [--quick] [--bf16]\n", argv[0]);
      return 2;
    }
  }
  const double min_s = quick ? 0.02 : 0.06;
  const int reps = quick ? 3 : 8;
  if (bf16) return bench_bf16(min_s, reps);
  const bool avx512 = ls::ops::gemm_path_supported(ls::ops::GemmPath::kAvx512);
  const int max_threads = std::min(2, omp_get_max_threads());

  double peak[3] = {0, 0, 0};
  for (int t = 1; t <= max_threads; ++t) peak[t] = peak_gflops(t, avx512, min_s);
  printf("lockstep-bench-gemm  path=%s  Eigen %d.%d.%d (%s)\n", ls::ops::gemm_path_name(),
         EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION,
         Eigen::SimdInstructionSetsInUse());
  printf("fp32 FMA peak (%s loop): 1 thread %.1f GFLOP/s", avx512 ? "AVX-512" : "AVX2",
         peak[1]);
  if (max_threads >= 2) printf(", 2 threads %.1f GFLOP/s", peak[2]);
  printf("\n");
  // The bf16 matrix peak, for the MFU of bf16 runs (tools/bench).
  const char* what = "";
  double bf16_peak[3] = {0, 0, 0};
  for (int t = 1; t <= max_threads; ++t) bf16_peak[t] = bf16_peak_gflops(t, min_s, &what);
  printf("bf16 peak (%s): 1 thread %.1f GFLOP/s", what, bf16_peak[1]);
  if (max_threads >= 2) printf(", 2 threads %.1f GFLOP/s", bf16_peak[2]);
  printf("\n\n");

  std::vector<Shape> shapes = {{256, 256, 256, true},     {512, 512, 512, true},
                               {1024, 1024, 1024, true},  {1024, 64, 192, false},
                               {1024, 256, 1024, false},  {1024, 1024, 256, false},
                               {8192, 64, 64, false},     {256, 64, 128, false},
                               {64, 1024, 64, false}};
  printf("%-16s %3s  %12s  %12s  %7s  %7s  %7s\n", "shape MxKxN", "thr", "contract", "eigen",
         "ratio", "%peak", "eig%pk");
  printf("%-16s %3s  %12s  %12s  %7s  %7s  %7s\n", "", "", "GFLOP/s", "GFLOP/s", "c/e", "", "");
  for (const Shape& s : shapes) {
    RowMat a = RowMat::Zero(s.m, s.k), b = RowMat::Zero(s.k, s.n), c = RowMat::Zero(s.m, s.n);
    for (int64_t i = 0; i < a.size(); ++i)
      a.data()[i] = ls::random_symmetric(1, ls::Purpose::kTest, i, 1.0f);
    for (int64_t i = 0; i < b.size(); ++i)
      b.data()[i] = ls::random_symmetric(2, ls::Purpose::kTest, i, 1.0f);
    const double flops = 2.0 * s.m * s.n * s.k;
    for (int t = 1; t <= (s.square ? max_threads : 1); ++t) {
      ls::ops::ConstMat A{a.data(), s.k, 1}, B{b.data(), s.n, 1};
      Eigen::setNbThreads(t);
      auto [g, e] = best_pair(
          flops, min_s, reps,
          [&] { ls::ops::gemm(s.m, s.n, s.k, A, B, c.data(), s.n, false, t); },
          [&] { c.noalias() = a * b; });
      std::string name = std::to_string(s.m) + "x" + std::to_string(s.k) + "x" +
                         std::to_string(s.n);
      printf("%-16s %3d  %12.1f  %12.1f  %7.2f  %6.1f%%  %6.1f%%\n", name.c_str(), t,
             g, e, g / e, 100.0 * g / peak[t], 100.0 * e / peak[t]);
      fflush(stdout);
    }
  }
  // The other paths (same bits, narrower vectors), for reference.
  {
    const int64_t n = 512;
    RowMat a = RowMat::Ones(n, n), b = RowMat::Ones(n, n), c = RowMat::Zero(n, n);
    ls::ops::ConstMat A{a.data(), n, 1}, B{b.data(), n, 1};
    printf("\nother paths, 512x512x512, 1 thread:");
    for (auto p : {ls::ops::GemmPath::kAvx2, ls::ops::GemmPath::kScalar}) {
      if (!ls::ops::gemm_path_supported(p)) continue;
      ls::ops::set_gemm_path(p);
      double g = best_gflops(2.0 * n * n * n, min_s, 2,
                             [&] { ls::ops::gemm(n, n, n, A, B, c.data(), n, false, 1); });
      printf("  %s %.1f GFLOP/s", ls::ops::gemm_path_name(), g);
    }
    ls::ops::set_gemm_path(ls::ops::GemmPath::kAuto);
    printf("\n");
  }
  return 0;
}
