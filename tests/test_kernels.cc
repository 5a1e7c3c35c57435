// The CUDA kernels (kernels/*.cuh) run on the CPU through the emulation of
// the CUDA built-ins (kernels/emu/cuda_emu.h): each kernel, at several grid
// and block shapes, bit for bit equal to the CPU engine's op. The emulator
// itself is checked first: its barriers separate what a block's threads do
// before them from what they do after, and a block whose threads disagree
// about a barrier is an error, not a silent pass.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "bits.h"
#include "cli_run.h"
#include "emu/backend.h"
#include "emu/cuda_emu.h"
#include "attention.cuh"
#include "elementwise.cuh"
#include "embedding.cuh"
#include "gemm.cuh"
#include "gemm_bf16.cuh"
#include "loss.cuh"
#include "moe.cuh"
#include "ops/attention.h"
#include "ops/dispatch.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "ops.h"  // reference/ops.h: the reference's own ops
#include "rmsnorm.cuh"
#include "runner/golden.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "tiny_scenario.h"
#include "weight_grad.cuh"

namespace {

std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Each thread writes its index, waits at the barrier, then reads its
// neighbour's: right only if the barrier really held every thread back.
__global__ void neighbour_after_barrier(int* out) {
  __shared__ int slot[256];
  const int t = threadIdx.x, n = blockDim.x;
  slot[t] = t + 1000 * (int)blockIdx.x;
  __syncthreads();
  out[blockIdx.x * n + t] = slot[(t + 1) % n];
}

__global__ void early_exit_before_barrier(int* out) {
  if (threadIdx.x == 0) return;  // thread 0 never reaches the barrier
  __syncthreads();
  out[threadIdx.x] = 1;
}

// fp32 inputs for the bf16 kernels, which round them to bf16 as they read.
enum class Bf16Values {
  kPlain,     // N(0, 1)
  kEdges,     // one in two: an fp32 subnormal, +-0, a tiny normal (products near or below 2^-126),
              // an exact bf16 rounding tie (one that carries into the exponent too)
  kSpecials,  // kEdges, and rarely +-inf, a quiet or signalling NaN, or a finite fp32 whose bf16 is inf
  kBoundary,  // exponents 2^-87..2^-48: products and sums around 2^-126
};

float bf16_edge_value(uint64_t u, float plain, bool specials) {
  const uint32_t pb = ls::bits(plain), sign = (uint32_t)(u >> 40) & 0x80000000u, r = (uint32_t)(u >> 8);
  switch (u % 24) {
    case 0: return ls::from_bits(sign | (1 + r % 0x7fffff));                  // an fp32 subnormal
    case 1: return ls::from_bits(sign | (0x7f0000u + r % 0x10000));           // rounds to 2^-126 or just below
    case 2: return -0.0f;
    case 3: return 0.0f;
    case 4:
    case 5: return ls::from_bits(sign | ((27 + r % 40) << 23) | (r >> 9 & 0x7fffff));  // 2^-100..2^-61
    case 6:
    case 7: return ls::from_bits((pb & 0xffff0000u) | 0x8000u);               // a tie: RNE picks the even one
    case 8: return ls::from_bits((pb & 0xff800000u) | 0x7f8000u);             // a tie that carries into the exponent
    case 9: return specials && r % 4 == 0 ? ls::from_bits(sign | 0x7f7f8000u | (r >> 4 & 0x7fff)) : plain;  // bf16 inf
    case 10: return specials && r % 8 == 0 ? ls::from_bits(sign | 0x7f800000u) : plain;                     // +-inf
    case 11: return specials && r % 16 == 0 ? ls::from_bits(0x7fc00000u | (r & 0x3fffff)) : plain;          // quiet NaN
    case 12: return specials && r % 16 == 0 ? ls::from_bits(0xff800001u | (r & 0x3fffff)) : plain;          // signalling NaN
    default: return plain;
  }
}

std::vector<float> bf16_test_floats(size_t n, uint64_t seed, Bf16Values kind) {
  std::mt19937_64 rng(seed * 7919 + 17);
  std::vector<float> v = random_floats(n, seed);
  for (float& x : v) {
    const uint64_t u = rng();
    if (kind == Bf16Values::kEdges || kind == Bf16Values::kSpecials)
      x = u % 2 ? bf16_edge_value(u >> 1, x, kind == Bf16Values::kSpecials) : x;
    if (kind == Bf16Values::kBoundary) x = ls::from_bits((uint32_t)(u & 0x807fffffu) | (uint32_t)(40 + (u >> 24) % 40) << 23);
  }
  return v;
}

std::vector<uint16_t> rounded_to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = ls::to_bf16(v[i]);
  return out;
}

// The bf16 weight-gradient rule, scalar: per leaf, per (i, j), ls::bf16_dot
// over the leaf's rows of the rounded X[n][i], dY[n][j] from +0; leaves
// combined by the contract's LeafTree (fp32 adds).
std::vector<float> weight_grad_bf16_scalar(const std::vector<float>& X, int64_t ldx, const std::vector<float>& dY,
                                           int64_t ldy, int in, int out, const std::vector<int64_t>& leaf_off) {
  const std::vector<uint16_t> x16 = rounded_to_bf16(X), dy16 = rounded_to_bf16(dY);
  const int64_t leaves = (int64_t)leaf_off.size() - 1, width = (int64_t)in * out;
  std::vector<float> scratch((size_t)(ls::LeafTree::levels_for(leaves) * width));
  ls::LeafTree tree(scratch.data(), width);
  for (int64_t l = 0; l < leaves; ++l) {
    const int64_t n0 = leaf_off[l], rows = leaf_off[l + 1] - n0;
    float* leaf = tree.next_leaf();
    for (int i = 0; i < in; ++i)
      for (int j = 0; j < out; ++j)
        leaf[i * out + j] = ls::bf16_dot(x16.data() + n0 * ldx + i, ldx, dy16.data() + n0 * ldy + j, ldy, rows, 0.0f);
    tree.push();
  }
  const float* sum = tree.finish();
  return std::vector<float>(sum, sum + width);
}

// The kernels' hooks on the emulated device, its memory installed, so every
// launch also proves its pointers are the device's.
struct EmulatedDevice {
  ls::ops::ExecutionTarget target;
  std::unique_ptr<ls::ops::ScopedExecutionTarget> installed;
  EmulatedDevice() {
    target.kernels = &ls::emu::kernel_hooks();
    target.memory = &ls::emu::registered_memory();
    installed = std::make_unique<ls::ops::ScopedExecutionTarget>(target);
  }
  const ls::ops::OpHooks& hooks() const { return *target.kernels; }
};

template <class T>
ls::ops::DeviceVector<T> on_device(const std::vector<T>& v) {
  return ls::ops::DeviceVector<T>(v.begin(), v.end());
}
template <class T>
std::vector<T> on_host(const ls::ops::DeviceVector<T>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// C after the emulated device's gemm_bf16 hook: the operands and C copied
// into its memory, the views' offsets and strides kept.
std::vector<float> gemm_bf16_hook(int64_t M, int64_t N, int64_t K, const std::vector<float>& a, ls::ops::ConstMat A,
                                  const std::vector<float>& b, ls::ops::ConstMat B, const std::vector<float>& c,
                                  int64_t ldc, bool accumulate) {
  const EmulatedDevice device;
  const ls::ops::DeviceVector<float> da = on_device(a), db = on_device(b);
  ls::ops::DeviceVector<float> dc = on_device(c);
  device.hooks().gemm_bf16(M, N, K, {da.data() + (A.p - a.data()), A.rs, A.cs},
                           {db.data() + (B.p - b.data()), B.rs, B.cs}, dc.data(), ldc, accumulate);
  device.hooks().synchronize();
  return on_host(dc);
}

// dW after the emulated device's weight_grad_bf16 hook.
std::vector<float> weight_grad_bf16_hook(const std::vector<float>& X, int64_t ldx, const std::vector<float>& dY,
                                         int64_t ldy, int in, int out, const std::vector<int64_t>& leaf_off) {
  const EmulatedDevice device;
  const ls::ops::DeviceVector<float> dx = on_device(X), ddy = on_device(dY);
  const ls::ops::DeviceVector<int64_t> doff = on_device(leaf_off);
  ls::ops::DeviceVector<float> dw((size_t)in * out, -1.0f);
  device.hooks().weight_grad_bf16(dx.data(), ldx, ddy.data(), ldy, in, out, doff.data(),
                                  (int64_t)leaf_off.size() - 1, dw.data());
  device.hooks().synchronize();
  return on_host(dw);
}

}  // namespace

// The golden gate's work list through the emulated kernels: every golden
// file's scenario and its mesh variants, each reproducing its golden file
// bit for bit. Half `half` (0 or 1) of the sorted list: the two halves are
// two suites, so that two test processes share the work (a run on the
// emulated device keeps about one core busy).
void golden_runs_through_kernels(size_t half) {
  namespace fs = std::filesystem;
  const fs::path root = LOCKSTEP_SOURCE_DIR;
  // The golden gate's work list: each golden file's scenario and the mesh
  // variants of the same name (scenarios/variants), as `lockstep check`.
  std::vector<std::pair<fs::path, fs::path>> work;  // (golden file, scenario)
  for (const auto& e : fs::directory_iterator(root / "golden")) {
    std::ifstream in(e.path());
    const nlohmann::json g = nlohmann::json::parse(in);
    work.push_back({e.path(), root / g.at("scenario").get<std::string>()});
  }
  for (const auto& e : fs::directory_iterator(root / "scenarios/variants"))
    work.push_back({root / "golden" / (ls::load_scenario(e.path().string(), {}).name + ".json"), e.path()});
  REQUIRE(work.size() >= 9);
  std::sort(work.begin(), work.end());
  int64_t launches = 0, total_syncs = 0;
  size_t bf16 = 0, ran = 0;  // bf16: of the whole list, at numerics.precision=bf16 (the kernels' bf16 fold)
  for (size_t w = 0; w < work.size(); ++w) {
    const auto& [gpath, spath] = work[w];
    CAPTURE(spath.string());
    std::ifstream in(gpath);
    REQUIRE(in);
    const nlohmann::json g = nlohmann::json::parse(in);
    const ls::Scenario s = ls::load_scenario(spath.string(), {});
    if (s.precision == "bf16") ++bf16;
    if (w % 2 != half) continue;
    ++ran;
    ls::RunOptions opt;
    opt.backend = ls::Backend::kCudaEmulated;
    opt.threads = 2;
    opt.eval = false;
    opt.hash_at = ls::golden_hash_steps(s.steps);
    const int64_t before = ls::emu::kernel_launches(), syncs_before = ls::emu::synchronizations();
    const ls::RunResult r = ls::run_scenario(s, opt);
    const int64_t n = ls::emu::kernel_launches() - before, syncs = ls::emu::synchronizations() - syncs_before;
    CHECK(r.backend == "cuda-emulated");
    CHECK(ls::compare_golden(g, r) == "");  // every loss bit, the state hashes, the final hash
    CHECK(n > 1000);  // the kernels really ran: GEMMs, gradients, norms, attention, MoE, loss, AdamW
    // ... asynchronously: queued, and run only where the host waits; a
    // missing wait would have the host read or rewrite what they had not
    // yet touched, and the golden bits would differ.
    CHECK(syncs * 2 < n);
    total_syncs += syncs;
    // ... every one of them handed only the emulated device's memory (a
    // host pointer throws): on a GPU, none would read host memory.
    launches += n;
  }
  MESSAGE(ran << " of " << work.size() << " golden runs (" << bf16 << " of them at bf16) through the emulated kernels, "
              << launches << " kernel launches, " << total_syncs << " host waits");
  CHECK(ran == (work.size() + 1 - half) / 2);
  CHECK(bf16 >= 13);  // top2_bf16, many_experts_bf16 and their 11 mesh variants
  CHECK(ls::ops::installed_kernels() == nullptr);  // the process is back on the engine's own ops
}

TEST_SUITE("kernels") {
  TEST_CASE("emulator: __syncthreads separates the block's threads, block by block, on any number of OS threads") {
    for (int os_threads : {1, 2, 4}) {
      CAPTURE(os_threads);
      for (unsigned n : {1u, 7u, 32u, 256u}) {
        CAPTURE(n);
        const unsigned blocks = 5;
        std::vector<int> out(blocks * n, -1);
        ls::emu::run_grid(dim3(blocks), dim3(n), [&] { neighbour_after_barrier(out.data()); }, os_threads);
        for (unsigned b = 0; b < blocks; ++b)
          for (unsigned t = 0; t < n; ++t) CHECK(out[b * n + t] == (int)((t + 1) % n + 1000 * b));
      }
    }
    std::vector<int> out(64);
    ls::emu::run_grid(dim3(1), dim3(64), [&] { neighbour_after_barrier(out.data()); }, 1);
    CHECK(ls::emu::last_block_barriers() == 1);  // one barrier passed: the threads really waited there
  }

  TEST_CASE("emulator: threads that disagree about a barrier are reported") {
    std::vector<int> out(8, 0);
    CHECK_THROWS_WITH_AS(ls::emu::run_grid(dim3(1), dim3(8), [&] { early_exit_before_barrier(out.data()); }, 1),
                         doctest::Contains("deadlock on a GPU"), std::logic_error);
  }

  TEST_CASE("contract GEMM kernel: bit for bit ops::gemm, at every shape, stride and grid") {
    struct Shape {
      int64_t M, N, K;
    };
    for (const Shape& sh : {Shape{1, 1, 1}, Shape{5, 7, 3}, Shape{32, 32, 16}, Shape{33, 65, 17}, Shape{64, 48, 100},
                            Shape{100, 37, 257}, Shape{8, 130, 0}}) {
      CAPTURE(sh.M);
      CAPTURE(sh.N);
      CAPTURE(sh.K);
      const std::vector<float> a = random_floats((size_t)(sh.M * std::max<int64_t>(sh.K, 1)), 1),
                               b = random_floats((size_t)(std::max<int64_t>(sh.K, 1) * sh.N), 2),
                               c0 = random_floats((size_t)(sh.M * sh.N), 3);
      for (bool transposed : {false, true})
        for (bool accumulate : {false, true}) {
          CAPTURE(transposed);
          CAPTURE(accumulate);
          // A as row-major M x K, or the transposed view of a K x M matrix.
          const ls::ops::ConstMat A = transposed ? ls::ops::ConstMat{a.data(), 1, sh.M} : ls::ops::ConstMat{a.data(), sh.K, 1};
          const ls::ops::ConstMat B{b.data(), sh.N, 1};
          std::vector<float> want = c0, got = c0;
          ls::ops::gemm(sh.M, sh.N, sh.K, A, B, want.data(), sh.N, accumulate);
          for (int os_threads : {1, 3}) {
            got = c0;
            ls::emu::run_grid(ls::kernels::contract_gemm_grid(sh.M, sh.N), ls::kernels::contract_gemm_block(), [&] {
              ls::kernels::contract_gemm(sh.M, sh.N, sh.K, ls::kernels::Mat{A.p, A.rs, A.cs},
                                         ls::kernels::Mat{B.p, B.rs, B.cs}, got.data(), sh.N, accumulate);
            }, os_threads);
            CHECK_SAME_BITS(got, want);
          }
        }
    }
  }

  TEST_CASE("contract GEMM kernel: an infinite B past K's last block is never multiplied by a zero pad") {
    // K = 17: the second k block holds one real value; a padded 0 * inf would turn the sums into NaN.
    const int64_t M = 4, N = 4, K = 17;
    std::vector<float> a(M * K, 1.0f), b(K * N, 1.0f), want(M * N), got(M * N);
    b[(K - 1) * N] = std::numeric_limits<float>::infinity();
    ls::ops::gemm(M, N, K, ls::ops::ConstMat{a.data(), K, 1}, ls::ops::ConstMat{b.data(), N, 1}, want.data(), N, false);
    ls::emu::run_grid(ls::kernels::contract_gemm_grid(M, N), ls::kernels::contract_gemm_block(), [&] {
      ls::kernels::contract_gemm(M, N, K, {a.data(), K, 1}, {b.data(), N, 1}, got.data(), N, false);
    });
    CHECK_SAME_BITS(got, want);
    CHECK(std::isinf(got[0]));
  }

  TEST_CASE("RMSNorm kernel: bit for bit ops::rmsnorm, at several block sizes") {
    for (int D : {1, 8, 64, 100}) {
      CAPTURE(D);
      const int64_t N = 77;
      const std::vector<float> x = random_floats((size_t)(N * D), 4), w = random_floats((size_t)D, 5);
      std::vector<float> y_want(N * D), r_want(N), y(N * D), r(N);
      ls::ops::rmsnorm(x.data(), w.data(), y_want.data(), r_want.data(), N, D, 1e-5f);
      for (unsigned block : {1u, 32u, 128u}) {
        CAPTURE(block);
        std::fill(y.begin(), y.end(), 0.0f);
        const dim3 grid((unsigned)((N + block - 1) / block));
        ls::emu::run_grid(grid, dim3(block), [&] {
          ls::kernels::rmsnorm_forward(x.data(), w.data(), y.data(), r.data(), N, D, 1e-5f);
        });
        CHECK_SAME_BITS(y, y_want);
        CHECK_SAME_BITS(r, r_want);
      }
    }
  }

  TEST_CASE("weight-gradient kernel: the leaf tree, bit for bit ops::weight_grad, empty leaves included") {
    struct Case {
      int in, out;
      std::vector<int64_t> leaf_off;
    };
    for (const Case& c : {Case{3, 5, {0, 4}}, Case{16, 16, {0, 3, 3, 9, 10}}, Case{33, 17, {0, 1, 2, 3, 4, 5, 6, 7}},
                          Case{8, 40, {0, 0, 0, 12}}, Case{20, 9, {0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96}}}) {
      CAPTURE(c.in);
      CAPTURE(c.out);
      const int64_t rows = c.leaf_off.back(), leaves = (int64_t)c.leaf_off.size() - 1;
      const int64_t ldx = c.in + 3, ldy = c.out + 1;  // strided rows, as the engine hands them over
      const std::vector<float> X = random_floats((size_t)(std::max<int64_t>(rows, 1) * ldx), 6),
                               dY = random_floats((size_t)(std::max<int64_t>(rows, 1) * ldy), 7);
      std::vector<float> want((size_t)c.in * c.out), got((size_t)c.in * c.out, -1.0f);
      ls::ops::weight_grad(X.data(), ldx, dY.data(), ldy, c.in, c.out, c.leaf_off.data(), leaves, want.data());
      for (dim3 block : {dim3(1, 1), dim3(8, 4), dim3(32, 8)}) {
        CAPTURE(block.x);
        const dim3 grid((unsigned)((c.out + block.x - 1) / block.x), (unsigned)((c.in + block.y - 1) / block.y));
        ls::emu::run_grid(grid, block, [&] {
          ls::kernels::weight_grad_leaves(X.data(), ldx, dY.data(), ldy, c.in, c.out, c.leaf_off.data(), leaves,
                                          got.data());
        });
        CHECK_SAME_BITS(got, want);
      }
    }
  }

  TEST_CASE("bf16 GEMM kernel (gemm_bf16 hook): bit for bit ops::gemm_bf16_naive on the rounded operands, at every shape, stride and edge value") {
    struct Shape {
      int64_t M, N, K;
    };
    const Bf16Values kinds[] = {Bf16Values::kPlain, Bf16Values::kEdges, Bf16Values::kSpecials, Bf16Values::kBoundary};
    for (const Shape& sh : {Shape{1, 1, 1}, Shape{5, 7, 3}, Shape{32, 32, 32}, Shape{33, 65, 17}, Shape{3, 5, 33},
                            Shape{31, 33, 64}, Shape{64, 48, 100}, Shape{40, 37, 257}, Shape{8, 130, 0}})
      for (Bf16Values kind : kinds)
        for (int layout = 0; layout < 4; ++layout)
          for (bool accumulate : {false, true}) {
            CAPTURE(sh.M);
            CAPTURE(sh.N);
            CAPTURE(sh.K);
            CAPTURE((int)kind);
            CAPTURE(layout);
            CAPTURE(accumulate);
            const bool ta = layout & 1, tb = layout & 2;
            const int64_t K1 = std::max<int64_t>(sh.K, 1), lda = K1 + 3, ldb = sh.N + 5, ldc = sh.N + 2;
            const uint64_t seed = 100 + (uint64_t)(sh.M * 7 + sh.N * 3 + sh.K) * 16 + (uint64_t)kind * 4 + layout;
            // A: row-major M x K with padded rows, or the transposed view of a K x M matrix;
            // B: row-major K x N with padded rows, or the transposed view of an N x K matrix.
            const std::vector<float> a = bf16_test_floats((size_t)(ta ? K1 * sh.M : sh.M * lda), seed, kind),
                                     b = bf16_test_floats((size_t)(tb ? sh.N * K1 : K1 * ldb), seed + 1, kind),
                                     c0 = bf16_test_floats((size_t)(sh.M * ldc), seed + 2, kind);
            const ls::ops::ConstMat A = ta ? ls::ops::ConstMat{a.data(), 1, sh.M} : ls::ops::ConstMat{a.data(), lda, 1};
            const ls::ops::ConstMat B = tb ? ls::ops::ConstMat{b.data(), 1, K1} : ls::ops::ConstMat{b.data(), ldb, 1};
            const std::vector<uint16_t> a16 = rounded_to_bf16(a), b16 = rounded_to_bf16(b);
            std::vector<float> want = c0, engine = c0;
            ls::ops::gemm_bf16_naive(sh.M, sh.N, sh.K, {a16.data(), A.rs, A.cs}, {b16.data(), B.rs, B.cs}, want.data(),
                                     ldc, accumulate);
            ls::ops::gemm_bf16_rounded(sh.M, sh.N, sh.K, A, B, engine.data(), ldc, accumulate);
            REQUIRE_SAME_BITS(engine, want);  // the definition and the engine agree: the kernel must give both
            // ... every element, the padding of C's rows (never written) included.
            CHECK_SAME_BITS(gemm_bf16_hook(sh.M, sh.N, sh.K, a, A, b, B, c0, ldc, accumulate), want);
          }
  }

  TEST_CASE("bf16 GEMM kernel: the fold's directed cases (tests/test_gemm_bf16.cc), rounding as read, K = 0, padding past K") {
    const float inf = std::numeric_limits<float>::infinity(), sub = ls::from_bits(0x00400000u);
    struct Case {
      const char* what;
      std::vector<float> a, b;  // k = 0, 1, ...: even k to E, odd k to O
      float start;              // accumulate from it
      uint32_t want;
    };
    const Case cases[] = {
        {"E = O = 2^-24 with C = 1: E + O first", {0x1p-24f, 0x1p-24f}, {1, 1}, 1.0f, ls::bits(1.0f + 0x1p-23f)},
        {"a tiny addend joins a normal E unflushed", {0x1p-62f, 0, 0x1p-63f}, {0x1p-63f, 0, 0x1p-64f}, 0.0f,
         ls::bits(0x1.4p-125f)},
        {"two 2^-127 products (E, O) give 0", {0x1p-63f, 0x1p-63f}, {0x1p-64f, 0x1p-64f}, 0.0f, 0u},
        {"E = 2^-126, O = -2^-127: O flushed", {0x1p-63f, -0x1p-63f}, {0x1p-63f, 0x1p-64f}, 0.0f, ls::bits(0x1p-126f)},
        {"a subnormal C counts as 0", {0x1p-63f}, {0x1p-63f}, sub, ls::bits(0x1p-126f)},
        {"tininess after rounding: 2^-126 - 2^-150 in E flushes (fma gives 2^-126)", {0x1p-63f, 0, 0x1p-75f},
         {0x1p-63f, 0, -0x1p-75f}, 0.0f, 0u},
        {"32 tiny negative products flush to -0 in E and O (no +0 pad), onto C = -0: -0",
         std::vector<float>(32, -0x1.fep-64f), std::vector<float>(32, 0x1p-63f), -0.0f, 0x80000000u},
        {"all products -0 from -0: +0", {-0.0f, -0.0f, -0.0f}, {1, 1, 1}, -0.0f, 0u},
        {"+2^254 in E, -2^254 in O: inf - inf, canonical NaN", {0x1p127f, 0x1p127f}, {0x1p127f, -0x1p127f}, 0.0f,
         0x7fc00000u},
        {"a NaN input: canonical NaN", {ls::from_bits(0x7fc5abcdu), 1}, {1, 1}, 0.0f, 0x7fc00000u},
        {"a signalling NaN input: canonical NaN", {ls::from_bits(0xff800001u)}, {1}, 0.0f, 0x7fc00000u},
        {"operands round to nearest even as read: 1 + 2^-8 is 1", {1.0f + 0x1p-8f}, {1}, 0.0f, ls::bits(1.0f)},
        {"1 + 3 * 2^-8 is 1 + 2^-6", {1.0f + 3 * 0x1p-8f}, {1}, 0.0f, ls::bits(1.0f + 0x1p-6f)},
        {"a finite fp32 above bf16's largest rounds to inf", {ls::from_bits(0x7f7fc000u)}, {1}, 0.0f, ls::bits(inf)},
        {"an fp32 subnormal operand counts as 0 (else 2^-127 * 2^126 would count)", {ls::from_bits(0x003fffffu), 1},
         {0x1p126f, 2}, 0.0f, ls::bits(2.0f)},
        {"K = 0 leaves the start untouched (a subnormal too)", {}, {}, sub, ls::bits(sub)},
    };
    for (const Case& c : cases) {
      INFO(c.what);
      const int64_t K = (int64_t)c.a.size();
      // A 33 x 33 tile of the same dot product: two blocks' edges, rows and columns past the first 32.
      const int64_t M = 33, N = 33, K1 = std::max<int64_t>(K, 1);
      std::vector<float> a((size_t)(M * K1), 0.0f), b((size_t)(K1 * N), 0.0f), c0((size_t)(M * N), c.start);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t k = 0; k < K; ++k) a[i * K1 + k] = c.a[k], b[k * N + i] = c.b[k];
      const std::vector<float> got = gemm_bf16_hook(M, N, K, a, {a.data(), K1, 1}, b, {b.data(), N, 1}, c0, N, true);
      CHECK(ls::bits(got[0]) == c.want);
      CHECK(ls::bits(got[M * N - 1]) == c.want);
      CHECK(ls::bits(gemm_bf16_hook(1, 1, K, a, {a.data(), K1, 1}, b, {b.data(), N, 1}, {c.start}, 1, true)[0]) ==
            c.want);
    }
    // K = 0 without accumulate: +0. K = 33: the second block holds one real pair, padded with +0 * +0, so an
    // infinite b there never meets a zero pad.
    std::vector<float> a(33, 1.0f), b(33, 1.0f);
    CHECK(ls::bits(gemm_bf16_hook(1, 1, 0, a, {a.data(), 1, 1}, b, {b.data(), 1, 1}, {-3.0f}, 1, false)[0]) == 0u);
    b[32] = inf;
    CHECK(gemm_bf16_hook(1, 1, 33, a, {a.data(), 33, 1}, b, {b.data(), 1, 1}, {0.0f}, 1, false)[0] == inf);
  }

  TEST_CASE("ops::matmul at numerics.precision=bf16 runs the gemm_bf16 kernel where kernels are installed, the engine's bits") {
    const int64_t M = 37, N = 45, K = 70;
    const std::vector<float> a = bf16_test_floats((size_t)(M * K), 501, Bf16Values::kEdges),
                             b = bf16_test_floats((size_t)(K * N), 502, Bf16Values::kEdges),
                             c0 = bf16_test_floats((size_t)(M * N), 503, Bf16Values::kPlain);
    std::vector<float> want = c0;
    ls::ops::gemm_bf16_rounded(M, N, K, {a.data(), K, 1}, {b.data(), 1, K}, want.data(), N, true);
    ls::ops::ExecutionTarget emulated;
    emulated.kernels = &ls::emu::kernel_hooks();
    emulated.memory = &ls::emu::registered_memory();
    emulated.precision = ls::Precision::kBf16;
    const ls::ops::ScopedExecutionTarget installed(emulated);
    const ls::ops::DeviceVector<float> da = on_device(a), db = on_device(b);
    ls::ops::DeviceVector<float> dc = on_device(c0);
    const int64_t before = ls::emu::kernel_launches();
    ls::ops::matmul(M, N, K, {da.data(), K, 1}, {db.data(), 1, K}, dc.data(), N, true);
    ls::ops::synchronize();
    CHECK(ls::emu::kernel_launches() == before + 1);
    CHECK_SAME_BITS(on_host(dc), want);
  }

  TEST_CASE("bf16 weight-gradient kernel (weight_grad_bf16 hook): per leaf the bf16 fold from +0, leaves by the leaf tree, bit for bit the scalar rule") {
    struct Case {
      int in, out;
      std::vector<int64_t> leaf_off;
    };
    std::vector<int64_t> many(38);  // 37 leaves of 0..9 rows
    for (size_t l = 1; l < many.size(); ++l) many[l] = many[l - 1] + (int64_t)((l * 7) % 10);
    const Bf16Values kinds[] = {Bf16Values::kPlain, Bf16Values::kEdges, Bf16Values::kSpecials, Bf16Values::kBoundary};
    for (const Case& c : {Case{3, 5, {0, 4}}, Case{16, 16, {0, 33, 33, 70, 71, 135}}, Case{33, 17, {7, 40, 41, 100}},
                          Case{8, 40, {0, 0, 0, 45}}, Case{5, 9, many}, Case{4, 3, {0, 64, 96, 97}}, Case{3, 4, {5}}})
      for (Bf16Values kind : kinds) {
        CAPTURE(c.in);
        CAPTURE(c.out);
        CAPTURE(c.leaf_off.size());
        CAPTURE((int)kind);
        const int64_t rows = std::max<int64_t>(c.leaf_off.back(), 1);
        const int64_t ldx = c.in + 3, ldy = c.out + 1;  // strided rows, as the engine hands them over
        const std::vector<float> X = bf16_test_floats((size_t)(rows * ldx), 300 + (uint64_t)kind, kind),
                                 dY = bf16_test_floats((size_t)(rows * ldy), 400 + (uint64_t)kind, kind);
        std::vector<float> want = weight_grad_bf16_scalar(X, ldx, dY, ldy, c.in, c.out, c.leaf_off),
                           got = weight_grad_bf16_hook(X, ldx, dY, ldy, c.in, c.out, c.leaf_off);
        if (c.leaf_off.size() > 2) {
          // A NaN through the tree's merges (plain fp32 adds: +inf + -inf, or two NaNs) has the payload and
          // sign of whichever operand the compiler or the GPU picks (x86 0xffc00000 or the first operand's,
          // CUDA 0x7fffffff): compared as the canonical NaN there. One leaf has no merge: its NaN is the
          // fold's 0x7fc00000, compared as is.
          for (std::vector<float>* v : {&want, &got})
            for (float& x : *v) x = ls::bf16_canonical_nan(x);
        }
        CHECK_SAME_BITS(got, want);
        if (kind == Bf16Values::kPlain && c.leaf_off.size() > 2) {
          // Not the fp32 rule: the same leaves' fma folds over the unrounded values differ.
          std::vector<float> fp32((size_t)c.in * c.out);
          ls::ops::weight_grad(X.data(), ldx, dY.data(), ldy, c.in, c.out, c.leaf_off.data(),
                               (int64_t)c.leaf_off.size() - 1, fp32.data());
          CHECK_FALSE(lstest::same_bits(fp32, want));
        }
      }
  }

  TEST_CASE("bf16 weight-gradient kernel: the fold's blocks start at each leaf's first row") {
    // One column, 40 rows of 2^-12 * 2^-12 onto a first row of 1: as one leaf the 33rd..40th products
    // fall in a second block; split as {0, 8, 40} they fold with other neighbours. Both equal the rule, and differ.
    const int64_t rows = 40;
    std::vector<float> X(rows, 0x1p-12f), dY(rows, 0x1p-12f);
    X[0] = 1.0f, dY[0] = 1.0f;
    const std::vector<int64_t> one_leaf = {0, 40}, two_leaves = {0, 8, 40};
    const std::vector<float> w1 = weight_grad_bf16_hook(X, 1, dY, 1, 1, 1, one_leaf),
                             w2 = weight_grad_bf16_hook(X, 1, dY, 1, 1, 1, two_leaves);
    CHECK_SAME_BITS(w1, weight_grad_bf16_scalar(X, 1, dY, 1, 1, 1, one_leaf));
    CHECK_SAME_BITS(w2, weight_grad_bf16_scalar(X, 1, dY, 1, 1, 1, two_leaves));
    CHECK_FALSE(lstest::same_bits(w1, w2));
  }

  TEST_CASE("SwiGLU kernels: bit for bit ops::swiglu and its backward") {
    const int64_t n = 1000;
    const std::vector<float> u = random_floats(n, 8), v = random_floats(n, 9), dact = random_floats(n, 10);
    std::vector<float> s(n), act(n), du(n), dv(n), ks(n), kact(n), kdu(n), kdv(n);
    ls::ops::swiglu(u.data(), v.data(), s.data(), act.data(), n);
    ls::ops::swiglu_backward(u.data(), v.data(), s.data(), dact.data(), du.data(), dv.data(), n);
    const dim3 grid((unsigned)((n + 127) / 128));
    ls::emu::run_grid(grid, dim3(128), [&] { ls::kernels::swiglu_forward(u.data(), v.data(), ks.data(), kact.data(), n); });
    ls::emu::run_grid(grid, dim3(128), [&] {
      ls::kernels::swiglu_backward(u.data(), v.data(), ks.data(), dact.data(), kdu.data(), kdv.data(), n);
    });
    CHECK_SAME_BITS(ks, s);
    CHECK_SAME_BITS(kact, act);
    CHECK_SAME_BITS(kdu, du);
    CHECK_SAME_BITS(kdv, dv);
  }

  TEST_CASE("softmax-rows kernel: bit for bit ops::softmax_rows, log-sum-exp included") {
    for (int n : {1, 8, 13, 64}) {
      CAPTURE(n);
      const int rows = 37;
      const int64_t ld = n + 2;
      std::vector<float> z = random_floats((size_t)rows * ld, 11);
      for (float& x : z) x = x * 4.0f;
      std::vector<float> p((size_t)rows * ld, 0.0f), lse(rows), kp((size_t)rows * ld, 0.0f), klse(rows);
      ls::ops::softmax_rows(z.data(), ld, p.data(), ld, rows, n, 0, lse.data());
      ls::emu::run_grid(dim3(3), dim3(16), [&] {
        ls::kernels::softmax_rows(z.data(), kp.data(), ld, rows, n, klse.data());
      });
      CHECK_SAME_BITS(kp, p);
      CHECK_SAME_BITS(klse, lse);
    }
  }

  TEST_CASE("gradient-norm kernels: blocks' fma folds, then the canonical tree, bit for bit ops::param_sumsq") {
    for (int64_t n : {int64_t{5}, int64_t{1024}, int64_t{1025}, int64_t{5000}, int64_t{70001}}) {
      CAPTURE(n);
      const std::vector<float> v = random_floats((size_t)n, 12);
      const int64_t blocks = (n + ls::kParamBlock - 1) / ls::kParamBlock;
      std::vector<float> sums((size_t)blocks), out(1);
      ls::emu::run_grid(dim3((unsigned)((blocks + 31) / 32)), dim3(32), [&] {
        ls::kernels::sumsq_blocks(v.data(), n, sums.data());
      });
      ls::emu::run_grid(dim3(1), dim3(1), [&] { ls::kernels::tree_over_blocks(sums.data(), blocks, out.data()); });
      const float want = ls::ops::param_sumsq(v.data(), n);
      CHECK(std::memcmp(&out[0], &want, 4) == 0);
    }
  }

  TEST_CASE("AdamW kernel: bit for bit adamw_update, with and without clipping and decay") {
    ls::OptimConfig cfg;
    cfg.weight_decay = 0.1f;
    const int64_t n = 3000;
    for (bool clip : {false, true})
      for (bool decay : {false, true}) {
        CAPTURE(clip);
        CAPTURE(decay);
        std::vector<float> w = random_floats(n, 13), g = random_floats(n, 14), m = random_floats(n, 15),
                           v = random_floats(n, 16);
        for (float& x : v) x = x * x;  // second moments are >= 0
        std::vector<float> kw = w, kg = g, km = m, kv = v;
        const int step = 6;
        const float lr = 3e-4f, scale = 0.5f;
        ls::adamw_update(cfg, lr, step, clip, scale, {ls::AdamWSlice{w.data(), g.data(), m.data(), v.data(), n, decay}});
        // The bias corrections as the engine makes them: beta^t by repeated multiplication.
        float p1 = 1.0f, p2 = 1.0f;
        for (int t = 0; t <= step; ++t) {
          p1 = p1 * cfg.beta1;
          p2 = p2 * cfg.beta2;
        }
        const ls::kernels::AdamWArgs args{cfg.beta1, cfg.beta2, 1.0f - cfg.beta1, 1.0f - cfg.beta2, 1.0f - p1, 1.0f - p2,
                                          cfg.eps, cfg.weight_decay, lr, scale, clip, decay};
        ls::emu::run_grid(dim3((unsigned)((n + 255) / 256)), dim3(256), [&] {
          ls::kernels::adamw_step(kw.data(), kg.data(), km.data(), kv.data(), n, args);
        });
        CHECK_SAME_BITS(kw, w);
        CHECK_SAME_BITS(kg, g);
        CHECK_SAME_BITS(km, m);
        CHECK_SAME_BITS(kv, v);
      }
  }

  TEST_CASE("RMSNorm backward kernels: bit for bit ops::rmsnorm_backward and ops::rmsnorm_weight_grad") {
    const int64_t N = 48;
    for (int D : {1, 16, 50}) {
      CAPTURE(D);
      const std::vector<float> x = random_floats((size_t)(N * D), 17), w = random_floats((size_t)D, 18),
                               dy = random_floats((size_t)(N * D), 19), h0 = random_floats((size_t)(N * D), 20);
      std::vector<float> y(N * D), r(N);
      ls::ops::rmsnorm(x.data(), w.data(), y.data(), r.data(), N, D, 1e-5f);
      for (bool accumulate : {false, true}) {
        CAPTURE(accumulate);
        std::vector<float> want = h0, got = h0;
        ls::ops::rmsnorm_backward(x.data(), w.data(), r.data(), dy.data(), want.data(), N, D, accumulate);
        ls::emu::run_grid(dim3(2), dim3(32), [&] {
          ls::kernels::rmsnorm_backward(x.data(), w.data(), r.data(), dy.data(), got.data(), N, D, accumulate);
        });
        CHECK_SAME_BITS(got, want);
      }
      for (int64_t leaf_tokens : {int64_t{1}, int64_t{3}, int64_t{16}}) {
        CAPTURE(leaf_tokens);
        std::vector<float> want(D), got(D);
        ls::ops::rmsnorm_weight_grad(x.data(), r.data(), dy.data(), N, D, leaf_tokens, want.data());
        ls::emu::run_grid(dim3((unsigned)((D + 7) / 8)), dim3(8), [&] {
          ls::kernels::rmsnorm_weight_grad(x.data(), r.data(), dy.data(), N, D, leaf_tokens, got.data());
        });
        CHECK_SAME_BITS(got, want);
      }
    }
  }

  TEST_CASE("attention kernels: probabilities, output and the three gradients bit for bit the engine's") {
    for (int S : {1, 5, 16, 17, 40}) {
      for (int hd : {8, 16}) {
        CAPTURE(S);
        CAPTURE(hd);
        const int64_t ld = 3 * hd + 5, ldo = hd + 2, ldd = hd + 1;
        const std::vector<float> qkv = random_floats((size_t)(S * ld), 21), dO = random_floats((size_t)(S * ldo), 22);
        const float *q = qkv.data(), *k = qkv.data() + hd, *v = qkv.data() + 2 * hd;
        const float scale = 1.0f / std::sqrt((float)hd);
        const size_t pf = (size_t)ls::ops::attention_probs_floats(S);
        REQUIRE(pf == (size_t)ls::kernels::attention_probs_floats(S));
        std::vector<float> P(pf, 0.0f), o(S * ldo, 0.0f), dq(S * ldd, 0.0f), dk(S * ldd, 0.0f), dv(S * ldd, 0.0f);
        ls::ops::AttentionScratch sc;
        ls::ops::attention_forward(q, k, v, ld, S, hd, scale, P.data(), o.data(), ldo, sc);
        ls::ops::attention_backward(q, k, v, ld, S, hd, scale, P.data(), dO.data(), ldo, dq.data(), dk.data(), dv.data(),
                                    ldd, sc);
        std::vector<float> kP(pf, 0.0f), ko(S * ldo, 0.0f), kdS(pf, 0.0f), kdq(S * ldd, 0.0f), kdk(S * ldd, 0.0f),
            kdv(S * ldd, 0.0f);
        for (unsigned block : {1u, 8u, 32u}) {
          CAPTURE(block);
          const dim3 grid((unsigned)((S + block - 1) / block));
          ls::emu::run_grid(grid, dim3(block), [&] {
            ls::kernels::attention_forward_rows(q, k, v, ld, S, hd, scale, kP.data(), ko.data(), ldo, false);
          });
          ls::emu::run_grid(grid, dim3(block), [&] {
            ls::kernels::attention_backward_rows(k, v, ld, S, hd, scale, kP.data(), dO.data(), ldo, kdS.data(),
                                                 kdq.data(), ldd);
          });
          ls::emu::run_grid(grid, dim3(block), [&] {
            ls::kernels::attention_backward_cols(q, ld, S, hd, kP.data(), kdS.data(), dO.data(), ldo, kdk.data(),
                                                 kdv.data(), ldd);
          });
          for (int t = 0; t < S; ++t)
            for (int u = 0; u <= t; ++u) {
              const float a = ls::ops::attention_prob(P.data(), S, t, u), b = kP[(size_t)ls::kernels::attn_index(S, t, u)];
              CHECK(std::memcmp(&a, &b, 4) == 0);
            }
          CHECK_SAME_BITS(ko, o);
          CHECK_SAME_BITS(kdq, dq);
          CHECK_SAME_BITS(kdk, dk);
          CHECK_SAME_BITS(kdv, dv);
        }
      }
    }
  }

  TEST_CASE("attention kernels over every head of a batch in one launch: bit for bit the engine's heads") {
    const int B = 3, H = 4, hd = 8, D = H * hd;
    for (int S : {5, 17}) {
      CAPTURE(S);
      const std::vector<float> qkv = random_floats((size_t)(B * S * 3 * D), 61), dO = random_floats((size_t)(B * S * D), 62);
      const float scale = 1.0f / std::sqrt((float)hd);
      const size_t pf = (size_t)(B * H) * (size_t)ls::ops::attention_probs_floats(S);
      std::vector<float> P(pf, 0.0f), o(B * S * D), dqkv(B * S * 3 * D), kP(pf, 0.0f), ko(B * S * D), kdS(pf),
          kdqkv(B * S * 3 * D);
      ls::ops::attention_forward_heads(qkv.data(), B, H, S, hd, scale, {P.data()}, o.data());
      ls::ops::attention_backward_heads(qkv.data(), B, H, S, hd, scale, {P.data()}, dO.data(), dqkv.data());
      const dim3 grid((unsigned)((S + 7) / 8), (unsigned)(B * H));
      ls::emu::run_grid(grid, dim3(8), [&] {
        ls::kernels::attention_forward_heads(qkv.data(), H, S, hd, scale, kP.data(), ko.data(), false);
      }, 1, false);
      ls::emu::run_grid(grid, dim3(8), [&] {
        ls::kernels::attention_backward_heads_rows(qkv.data(), H, S, hd, scale, kP.data(), dO.data(), kdS.data(),
                                                   kdqkv.data());
      }, 1, false);
      ls::emu::run_grid(grid, dim3(8), [&] {
        ls::kernels::attention_backward_heads_cols(qkv.data(), H, S, hd, kP.data(), kdS.data(), dO.data(), kdqkv.data());
      }, 1, false);
      CHECK_SAME_BITS(ko, o);
      CHECK_SAME_BITS(kdqkv, dqkv);  // dq, dk and dv of every head in place
      int same_probs = 0;
      for (int bh = 0; bh < B * H; ++bh)
        for (int t = 0; t < S; ++t)
          for (int u = 0; u <= t; ++u) {
            const float* p0 = P.data() + bh * ls::ops::attention_probs_floats(S);
            const float a = ls::ops::attention_prob(p0, S, t, u), b = kP[bh * ls::ops::attention_probs_floats(S) + ls::kernels::attn_index(S, t, u)];
            same_probs += std::memcmp(&a, &b, 4) == 0;
          }
      CHECK(same_probs == B * H * S * (S + 1) / 2);
    }
  }

  TEST_CASE("MoE kernels: routing, combine and its backward bit for bit the engine's ops") {
    const int64_t N = 37;
    const int E = 8, K = 2, D = 24;
    std::vector<float> g = random_floats((size_t)(N * E), 23);
    g[3] = g[5];  // a tie: the lower index wins
    std::vector<int> sel(N * K), ksel(N * K, -1);
    ls::ops::route_topk(g.data(), N, E, K, sel.data());
    ls::emu::run_grid(dim3(3), dim3(16), [&] { ls::kernels::route_topk(g.data(), N, E, K, ksel.data()); }, 1, false);
    CHECK(ksel == sel);
    // Expert rows: (token, slot) q's output sits at a permuted row, as after dispatch.
    std::vector<int64_t> row_of(N * K);
    for (int64_t q = 0; q < N * K; ++q) row_of[q] = (q * 17) % (N * K);
    const std::vector<float> ye = random_floats((size_t)(N * K * D), 24), shared = random_floats((size_t)(N * D), 25),
                             residual = random_floats((size_t)(N * D), 26), dh = random_floats((size_t)(N * D), 27);
    for (bool with_shared : {false, true}) {
      std::vector<float> want(N * D), got(N * D);
      const float* sh = with_shared ? shared.data() : nullptr;
      ls::ops::moe_combine(g.data(), E, sel.data(), K, row_of.data(), ye.data(), sh, residual.data(), want.data(), N, D);
      ls::emu::run_grid(dim3(2), dim3(32), [&] {
        ls::kernels::moe_combine(g.data(), E, sel.data(), K, row_of.data(), ye.data(), sh, residual.data(), got.data(), N, D);
      }, 1, false);
      CHECK_SAME_BITS(got, want);
    }
    std::vector<float> dg(N * E, 0.0f), dye(N * K * D), kdg(N * E, 0.0f), kdye(N * K * D);
    ls::ops::moe_combine_backward(dh.data(), g.data(), E, sel.data(), K, row_of.data(), ye.data(), dg.data(), dye.data(), N, D);
    ls::emu::run_grid(dim3(3), dim3(32), [&] {
      ls::kernels::moe_combine_backward(dh.data(), g.data(), E, sel.data(), K, row_of.data(), ye.data(), kdg.data(),
                                        kdye.data(), N, D);
    }, 1, false);
    CHECK_SAME_BITS(kdg, dg);
    CHECK_SAME_BITS(kdye, dye);
  }

  TEST_CASE("kernels against the reference's own ops (reference/ops.h), bit for bit: matmul, RMSNorm, softmax, weight gradients, attention") {
    const int64_t N = 24;
    const int D = 20, V = 13, S = 12, hd = 5;
    const std::vector<float> x = random_floats((size_t)(N * D), 51), W = random_floats((size_t)(D * V), 52),
                             w = random_floats((size_t)D, 53), dy = random_floats((size_t)(N * D), 54),
                             dY = random_floats((size_t)(N * V), 55);
    auto grid = [](int64_t n, unsigned per) { return dim3((unsigned)((n + per - 1) / per)); };
    // Y = X W: ref::dot_col per token and output feature.
    std::vector<float> y(N * V), want(N * V);
    ls::emu::run_grid(ls::kernels::contract_gemm_grid(N, V), ls::kernels::contract_gemm_block(), [&] {
      ls::kernels::contract_gemm(N, V, D, ls::kernels::Mat{x.data(), D, 1}, ls::kernels::Mat{W.data(), V, 1}, y.data(), V, false);
    }, 1, true);
    for (int64_t n = 0; n < N; ++n)
      for (int j = 0; j < V; ++j) want[n * V + j] = ref::dot_col(false, &x[n * D], W.data(), V, j, D);
    CHECK_SAME_BITS(y, want);
    // RMSNorm and its backward, token by token.
    std::vector<float> yn(N * D), r(N), dx(N * D), yref(N * D), rref(N), dxref(N * D);
    ls::emu::run_grid(grid(N, 8), dim3(8), [&] { ls::kernels::rmsnorm_forward(x.data(), w.data(), yn.data(), r.data(), N, D, 1e-5f); }, 1, false);
    ls::emu::run_grid(grid(N, 8), dim3(8), [&] {
      ls::kernels::rmsnorm_backward(x.data(), w.data(), r.data(), dy.data(), dx.data(), N, D, false);
    }, 1, false);
    for (int64_t n = 0; n < N; ++n) {
      rref[n] = ref::rmsnorm(&x[n * D], w.data(), &yref[n * D], D, 1e-5f);
      ref::rmsnorm_backward(&x[n * D], w.data(), rref[n], &dy[n * D], &dxref[n * D], D);
    }
    CHECK_SAME_BITS(yn, yref);
    CHECK_SAME_BITS(r, rref);
    CHECK_SAME_BITS(dx, dxref);
    // Softmax rows with log-sum-exp, and the backward.
    std::vector<float> p(N * V), lse(N), dz(N * V), pref(N * V), lseref(N), dzref(N * V);
    ls::emu::run_grid(grid(N, 16), dim3(16), [&] { ls::kernels::softmax_rows(y.data(), p.data(), V, (int)N, V, lse.data()); }, 1, false);
    ls::emu::run_grid(grid(N, 16), dim3(16), [&] { ls::kernels::softmax_backward_rows(p.data(), dY.data(), dz.data(), V, (int)N, V); }, 1, false);
    for (int64_t n = 0; n < N; ++n) {
      lseref[n] = ref::softmax(&y[n * V], &pref[n * V], V);
      ref::softmax_backward(&pref[n * V], &dY[n * V], &dzref[n * V], V);
    }
    CHECK_SAME_BITS(p, pref);
    CHECK_SAME_BITS(lse, lseref);
    CHECK_SAME_BITS(dz, dzref);
    // dW = X^T dY over tokens: ref::token_reduce (leaf folds, the canonical tree).
    for (int64_t leaf : {int64_t{1}, int64_t{4}, int64_t{24}}) {
      CAPTURE(leaf);
      std::vector<int64_t> off((size_t)(N / leaf + 1));
      for (size_t l = 0; l < off.size(); ++l) off[l] = (int64_t)l * leaf;
      std::vector<float> dW(D * V), dWref(D * V);
      ls::emu::run_grid(dim3((unsigned)((V + 7) / 8), (unsigned)((D + 7) / 8)), dim3(8, 8), [&] {
        ls::kernels::weight_grad_leaves(x.data(), D, dY.data(), V, D, V, off.data(), N / leaf, dW.data());
      }, 1, false);
      for (int i = 0; i < D; ++i)
        for (int j = 0; j < V; ++j)
          dWref[i * V + j] = ref::token_reduce<float>(N, leaf, [&](int64_t n, float acc) {
            return ref::FMA(x[n * D + i], dY[n * V + j], acc);
          });
      CHECK_SAME_BITS(dW, dWref);
    }
    // Causal attention of one head: the output and every probability.
    const std::vector<float> qkv = random_floats((size_t)(S * 3 * hd), 56);
    const float scale = 1.0f / ls::sqrt((float)hd);
    std::vector<float> P((size_t)ls::kernels::attention_probs_floats(S)), o(S * hd), Pref(S * S), oref(S * hd);
    ls::emu::run_grid(grid(S, 4), dim3(4), [&] {
      ls::kernels::attention_forward_rows(qkv.data(), qkv.data() + hd, qkv.data() + 2 * hd, 3 * hd, S, hd, scale,
                                          P.data(), o.data(), hd, false);
    }, 1, false);
    ref::attention_head(qkv.data(), qkv.data() + hd, qkv.data() + 2 * hd, (int64_t)3 * hd, S, hd, scale, Pref.data(),
                        oref.data(), (int64_t)hd);
    CHECK_SAME_BITS(o, oref);
    int same_probs = 0;
    for (int t = 0; t < S; ++t)
      for (int u = 0; u <= t; ++u) {
        const float a = ls::ops::attention_prob(P.data(), S, t, u), b = Pref[t * S + u];
        same_probs += std::memcmp(&a, &b, 4) == 0;
      }
    CHECK(same_probs == S * (S + 1) / 2);
  }

  TEST_CASE("dispatch and step kernels: row copies, slot sums, router gradient terms, adds and fills bit for bit the engine's") {
    const int64_t N = 29;
    const int K = 3, D = 20, E = 7;
    const std::vector<float> rows = random_floats((size_t)(N * K * D), 31), a = random_floats((size_t)(N * D), 32),
                             b = random_floats((size_t)(N * D), 33), g = random_floats((size_t)(N * E), 34),
                             lse = random_floats((size_t)N, 35), vec = random_floats((size_t)E, 36),
                             dz0 = random_floats((size_t)(N * E), 37);
    std::vector<int64_t> row_of(N * K), src(N * K), dst(N * K);
    for (int64_t q = 0; q < N * K; ++q) row_of[q] = (q * 11) % (N * K);
    for (int64_t t = 0; t < N * K; ++t) src[t] = (t * 7 + 3) % (N * K), dst[t] = (N * K - 1 - t);
    for (unsigned block : {32u, 128u}) {
      auto run = [&](int64_t threads, const std::function<void()>& body) {
        ls::emu::run_grid(dim3((unsigned)((threads + block - 1) / block)), dim3(block), body, 1, false);
      };
      CAPTURE(block);
      // Row copies with both index lists, one, or none.
      for (int which = 0; which < 4; ++which) {
        const int64_t* s = which & 1 ? src.data() : nullptr;
        const int64_t* d = which & 2 ? dst.data() : nullptr;
        std::vector<float> want(N * K * D, -1.0f), got(N * K * D, -1.0f);
        ls::ops::copy_rows(rows.data(), s, want.data(), d, N * K, D);
        run(N * K * D, [&] { ls::kernels::copy_rows(rows.data(), s, got.data(), d, N * K, D); });
        CHECK_SAME_BITS(got, want);
      }
      std::vector<float> want(N * D), got(N * D, 5.0f);
      ls::ops::slot_sum(rows.data(), row_of.data(), K, N, D, want.data());
      run(N * D, [&] { ls::kernels::slot_sum(rows.data(), row_of.data(), K, N, D, got.data()); });
      CHECK_SAME_BITS(got, want);
      ls::ops::add(a.data(), b.data(), want.data(), N * D);
      run(N * D, [&] { ls::kernels::add(a.data(), b.data(), got.data(), N * D); });
      CHECK_SAME_BITS(got, want);
      ls::ops::fill(want.data(), N * D, -0.0f);
      run(N * D, [&] { ls::kernels::fill(got.data(), N * D, -0.0f); });
      CHECK_SAME_BITS(got, want);
      // The router gradient: the aux term on some columns, then the z term.
      std::vector<float> dzw = dz0, dzk = dz0;
      ls::ops::add_row_vector(dzw.data(), N, E, E - 2, vec.data());
      run(N * (E - 2), [&] { ls::kernels::add_row_vector(dzk.data(), N, E, E - 2, vec.data()); });
      CHECK_SAME_BITS(dzk, dzw);
      CHECK(dzk[E - 1] == dz0[E - 1]);  // columns past `cols` untouched
      ls::ops::z_loss_grad(g.data(), lse.data(), N, E, 2.0f * 1e-3f, (float)(N * 4), dzw.data());
      run(N * E, [&] { ls::kernels::z_loss_grad(g.data(), lse.data(), N, E, 2.0f * 1e-3f, (float)(N * 4), dzk.data()); });
      CHECK_SAME_BITS(dzk, dzw);
      CHECK(!lstest::same_bits(dzk, dz0));
      std::vector<float> u = random_floats((size_t)(N * D), 38), sg(N * D), v = random_floats((size_t)(N * D), 39),
                         act(N * D), pw(N * D), pk(N * D);
      ls::ops::swiglu(u.data(), v.data(), sg.data(), act.data(), N * D);
      ls::ops::swiglu_product(u.data(), sg.data(), v.data(), pw.data(), N * D);
      run(N * D, [&] { ls::kernels::swiglu_product(u.data(), sg.data(), v.data(), pk.data(), N * D); });
      CHECK_SAME_BITS(pk, pw);
      CHECK_SAME_BITS(pk, act);  // the forward's product, bit for bit
    }
  }

  TEST_CASE("embedding kernels: the lookup and the leaf-tree scatter-add gradient bit for bit the engine's") {
    const int S = 8, D = 12, V = 40;
    for (int64_t leaf_samples : {int64_t{1}, int64_t{2}}) {
      CAPTURE(leaf_samples);
      const int64_t N = 6 * S, leaf_tokens = leaf_samples * S, leaves = N / leaf_tokens;
      std::mt19937_64 rng(28);
      std::vector<int> tok(N);
      for (int& t : tok) t = (int)(rng() % 12);  // most bytes absent: empty leaves and rows
      const std::vector<float> te = random_floats((size_t)V * D, 29), pe = random_floats((size_t)S * D, 30),
                               dh = random_floats((size_t)(N * D), 31);
      std::vector<float> h(N * D), kh(N * D), gt(V * D), gp(S * D), kgt(V * D, -1.0f), kgp(S * D, -1.0f);
      ls::ops::embed(tok.data(), te.data(), pe.data(), h.data(), N, S, D);
      ls::ops::embedding_grad(tok.data(), dh.data(), N, S, D, V, leaf_tokens, leaves, gt.data(), gp.data());
      ls::emu::run_grid(dim3(1), dim3(64), [&] { ls::kernels::embed(tok.data(), te.data(), pe.data(), kh.data(), N, S, D); },
                        1, false);
      ls::emu::run_grid(dim3((unsigned)(((V + S) * D + 127) / 128)), dim3(128), [&] {
        ls::kernels::embedding_grad(tok.data(), dh.data(), N, S, D, V, leaf_tokens, leaves, kgt.data(), kgp.data());
      }, 2, false);
      CHECK_SAME_BITS(kh, h);
      CHECK_SAME_BITS(kgt, gt);
      CHECK_SAME_BITS(kgp, gp);
    }
  }

  TEST_CASE("loss kernels: per-token cross-entropy, its gradient and the sum over tokens bit for bit the engine's") {
    const int64_t N = 96;
    const int V = 40;
    std::mt19937_64 rng(32);
    std::vector<int> target(N);
    for (int& t : target) t = (int)(rng() % V);
    const std::vector<float> logits = random_floats((size_t)(N * V), 33);
    std::vector<float> prob(N * V), lse(N), loss(N), kloss(N);
    ls::ops::softmax_rows(logits.data(), V, prob.data(), V, (int)N, V, 0, lse.data());
    ls::ops::token_losses(lse.data(), logits.data(), target.data(), N, V, loss.data());
    ls::emu::run_grid(dim3(2), dim3(64), [&] {
      ls::kernels::token_losses(lse.data(), logits.data(), target.data(), N, V, kloss.data());
    }, 1, false);
    CHECK_SAME_BITS(kloss, loss);
    for (float Ng : {96.0f, 128.0f, 1000.0f}) {  // a power of two takes the reciprocal path
      CAPTURE(Ng);
      std::vector<float> d(N * V), kd(N * V);
      ls::ops::cross_entropy_grad(prob.data(), target.data(), N, V, Ng, d.data());
      ls::emu::run_grid(dim3(2), dim3(64), [&] {
        ls::kernels::cross_entropy_grad(prob.data(), target.data(), N, V, Ng, kd.data());
      }, 1, false);
      CHECK_SAME_BITS(kd, d);
    }
    for (int64_t leaf_tokens : {int64_t{1}, int64_t{8}, int64_t{96}}) {
      CAPTURE(leaf_tokens);
      const int64_t leaves = N / leaf_tokens;
      std::vector<float> part((size_t)leaves), out(1);
      ls::emu::run_grid(dim3((unsigned)((leaves + 31) / 32)), dim3(32), [&] {
        ls::kernels::leaf_sums(loss.data(), leaves, leaf_tokens, part.data());
      }, 1, false);
      ls::emu::run_grid(dim3(1), dim3(1), [&] { ls::kernels::tree_over_blocks(part.data(), leaves, out.data()); }, 1, false);
      const float want = ls::ops::token_sum(loss.data(), N, leaf_tokens);
      CHECK(std::memcmp(&out[0], &want, 4) == 0);
      // The router statistics over the same leaves: gates per expert, lse^2.
      const int E = 8;
      const std::vector<float> g = random_floats((size_t)(N * E), 34);
      std::vector<float> sums(E + 1), ksums(E + 1);
      ls::ops::router_stats(g.data(), lse.data(), N, E, leaf_tokens, leaves, sums.data());
      ls::emu::run_grid(dim3(1), dim3(16), [&] {
        ls::kernels::router_stats(g.data(), lse.data(), E, leaf_tokens, leaves, ksums.data());
      }, 1, false);
      CHECK_SAME_BITS(ksums, sums);
    }
  }

  TEST_CASE("the emulated device: launches queue until the host synchronizes; one handed a host pointer is refused, naming the kernel and argument") {
    ls::ops::ExecutionTarget emulated;
    emulated.kernels = &ls::emu::kernel_hooks();
    emulated.memory = &ls::emu::registered_memory();
    const ls::ops::ScopedExecutionTarget installed(emulated);
    const ls::ops::DeviceVector<float> a(100, 1.0f), b(100, 2.0f);
    ls::ops::DeviceVector<float> out(100);
    const int64_t before = ls::emu::kernel_launches();
    ls::ops::add(a.data(), b.data(), out.data(), 100);  // device memory throughout: queued
    CHECK(ls::emu::kernel_launches() == before);         // launched as on a GPU: not yet run...
    CHECK(out[99] == 0.0f);                              // ...so the host must not read yet
    ls::ops::synchronize();
    CHECK(ls::emu::kernel_launches() == before + 1);
    CHECK(out[99] == 3.0f);
    std::vector<float> host(100);
    CHECK_THROWS_WITH_AS(ls::ops::add(a.data(), b.data(), host.data(), 100),
                         doctest::Contains("kernel add, argument 2: a pointer outside the device's memory"),
                         std::logic_error);
    CHECK_THROWS_WITH_AS(ls::ops::add(a.data() + 50, host.data(), out.data(), 50),
                         doctest::Contains("kernel add, argument 1"), std::logic_error);
    CHECK(ls::emu::kernel_launches() == before + 1);  // neither ran
    // Without the emulated device's memory installed, nothing is checked.
    emulated.memory = nullptr;
    ls::ops::install(emulated);
    ls::ops::add(a.data(), b.data(), host.data(), 100);
    ls::ops::synchronize();
    CHECK(host[0] == 3.0f);
  }

  TEST_CASE("--backend cuda-emulated: the first half of the golden scenarios and mesh variants, trained through the kernels, reproduces their golden files") {
    golden_runs_through_kernels(0);
  }

  TEST_CASE("a supervised cuda-emulated run: its children train on the kernels, one is killed, the job ends on the engine's hash") {
    const auto sc = lstest::write_temp("kernels_tiny.json", lstest::tiny_scenario(true));
    const auto dir = lstest::cli_temp_dir() / "kernels-sup";
    std::filesystem::remove_all(dir);
    const lstest::CliResult engine = lstest::run_cli("run " + sc.string() + " --json --quiet --set train.steps=6");
    REQUIRE(engine.rc == 0);
    const lstest::CliResult sup = lstest::run_cli("run " + sc.string() + " --backend cuda-emulated --json --quiet " +
                                                  "--set train.steps=6 --set ckpt.every=2 --set ckpt.url=" + dir.string() +
                                                  " --fault process_kill@4");
    CAPTURE(sup.err);
    REQUIRE(sup.rc == 0);
    auto last_json = [](const std::string& out) {
      const size_t nl = out.find_last_of('\n', out.size() - 2);
      return nlohmann::json::parse(nl == std::string::npos ? out : out.substr(nl + 1));
    };
    const nlohmann::json j = last_json(sup.out), e = last_json(engine.out);
    CHECK(j["backend"] == "cuda-emulated");
    CHECK(j["restarts"].size() == 1);
    CHECK(j["final_state_hash"] == e["final_state_hash"]);
    CHECK(lstest::run_cli("run " + sc.string() + " --backend reference --supervise --set ckpt.url=/tmp/x --set ckpt.every=1").rc == 2);
  }

  TEST_CASE("--backend cuda: on a GPU the engine's bits; without one it stops at once, saying why") {
    const auto sc = lstest::write_temp("kernels_cuda.json", lstest::tiny_scenario(true));
    const lstest::CliResult engine = lstest::run_cli("run " + sc.string() + " --json --quiet --set train.steps=3");
    REQUIRE(engine.rc == 0);
    const lstest::CliResult gpu = lstest::run_cli("run " + sc.string() + " --backend cuda --json --quiet --set train.steps=3");
    CAPTURE(gpu.err);
    if (gpu.rc == 0) {  // a machine with a GPU (tools/gpu-check runs the whole golden gate there)
      const auto last = [](const std::string& out) {
        const size_t nl = out.find_last_of('\n', out.size() - 2);
        return nlohmann::json::parse(nl == std::string::npos ? out : out.substr(nl + 1));
      };
      const nlohmann::json j = last(gpu.out), e = last(engine.out);
      CHECK(j["backend"] == "cuda");
      CHECK(j.contains("device"));
      CHECK(j["final_state_hash"] == e["final_state_hash"]);
      CHECK(j["losses"] == e["losses"]);
    } else {  // this project's CI and development machines: no GPU, or no nvcc in the build
      CHECK(gpu.rc == 2);
      CHECK(gpu.err.find("lockstep: error: --backend cuda: ") == 0);
      CHECK(gpu.out.find("final_state_hash") == std::string::npos);  // nothing trained
      // Where nvcc built the library, it was loaded and its entry point ran:
      // the refusal comes from the CUDA runtime inside it.
      const std::filesystem::path lib =
          std::filesystem::path(LOCKSTEP_BIN).parent_path().parent_path().parent_path() / "kernels/liblockstep-cuda.so";
      if (std::filesystem::exists(lib)) CHECK(gpu.err.find("NVIDIA GPU") != std::string::npos);
      // What to do instead, and not CUDA's "driver version is insufficient",
      // which is what the runtime says where no driver is installed at all.
      CHECK(gpu.err.find("--backend cuda-emulated") != std::string::npos);
      CHECK(gpu.err.find("driver version is insufficient") == std::string::npos);
    }
    // A library that is not a lockstep backend is named and refused.
    setenv("LOCKSTEP_CUDA_BACKEND", "libm.so.6", 1);
    const lstest::CliResult wrong = lstest::run_cli("run " + sc.string() + " --backend cuda --quiet");
    unsetenv("LOCKSTEP_CUDA_BACKEND");
    CHECK(wrong.rc == 2);
    CHECK(wrong.err.find("libm.so.6") != std::string::npos);
  }

  // A device run carries at most 64 MiB with the working tree (about 5 MB):
  // the pack of binaries and libraries (70 MB unpacked, OpenBLAS 36 MB of
  // it) must travel compressed, well under that, and unpack there whole.
  TEST_CASE("tools/gpu-pack makes one file of at most 40 MB that tools/gpu-check --pack unpacks and starts") {
    namespace fs = std::filesystem;
    const fs::path build = fs::path(LOCKSTEP_BIN).parent_path().parent_path().parent_path();
    const fs::path root = LOCKSTEP_SOURCE_DIR;
    if (!fs::exists(build / "kernels/liblockstep-cuda.so") || !fs::exists(build / "tools/lockstep-gpu-check")) {
      std::printf("lockstep-skip: kernels: gpu-pack needs the nvcc outputs (kernels/liblockstep-cuda.so, "
                  "tools/lockstep-gpu-check) in %s: built without nvcc\n", build.c_str());
      return;
    }
    const fs::path dir = lstest::fresh_dir("gpu-carry");
    const auto sh = [](const std::string& cmd) {
      const fs::path out = lstest::cli_temp_dir() / "sh.out";
      const int status = std::system((cmd + " >" + out.string() + " 2>&1").c_str());
      return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), lstest::slurp(out));
    };
    const auto [rc, out] = sh((root / "tools/gpu-pack").string() + " --build " + build.string() + " " + dir.string());
    CAPTURE(out);
    REQUIRE(rc == 0);
    // One file, and nothing else to carry.
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
    REQUIRE(files.size() == 1);
    CHECK(files[0].filename() == "lockstep-gpu-pack.tar.gz");
    const uintmax_t bytes = fs::file_size(files[0]);
    CAPTURE(bytes);
    CHECK(bytes <= 40000000u);
    CHECK(bytes > 5000000u);  // the libraries are in it, not left out
    CHECK(out.find(std::to_string(bytes) + " bytes in ") != std::string::npos);
    // Unpacked as the device would: the three binaries, OpenBLAS, and lockstep starts on the packed libraries.
    const auto [urc, uout] = sh((root / "tools/gpu-check").string() + " --pack " + dir.string() + " --unpack-only");
    CAPTURE(uout);
    CHECK(urc == 0);
    CHECK(uout.find("lockstep 0.1.0") != std::string::npos);
    for (const char* f : {"bin/lockstep", "bin/liblockstep-cuda.so", "bin/lockstep-gpu-check", "lib/libopenblas.so.0"}) {
      CAPTURE(f);
      CHECK(fs::exists(dir / f));
    }
    fs::remove_all(dir);
  }
}

TEST_SUITE("kernels_golden") {
  TEST_CASE("--backend cuda-emulated: the second half of the golden scenarios and mesh variants, trained through the kernels, reproduces their golden files") {
    golden_runs_through_kernels(1);
  }
}
