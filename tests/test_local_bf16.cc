// The `local` level at numerics.precision=bf16 (docs/NUMERICS.md §10): the
// bf16 recipe's products on oneDNN's bf16 matmul, fp32 accumulation in the
// library's order. Not bitwise against the contract: held to its bf16 GEMM
// by tolerance, and oneDNN must really have run (its call counter, the
// summary's library name). A build without oneDNN refuses the combination.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cli_run.h"
#include "contract.h"
#include "ops/gemm_bf16.h"
#include "ops/local.h"
#include "runner/runner.h"
#include "runner/scenario.h"

namespace {

const std::string kRoot = LOCKSTEP_SOURCE_DIR;

ls::RunResult train_bf16(const std::string& level, int steps, int threads, const std::string& precision = "bf16") {
  ls::Scenario s = ls::load_scenario(kRoot + "/scenarios/top2.json",
                                     {"numerics.level=" + level, "numerics.precision=" + precision,
                                      "train.steps=" + std::to_string(steps)});
  ls::RunOptions opt;
  opt.threads = threads;
  opt.eval = false;
  return ls::run_scenario(s, opt);
}

// One product in the layouts the engine passes (A or B transposed, C wider
// than N, accumulating, a matrix with neither stride 1).
struct Case {
  int64_t m, n, k;
  bool a_transposed, b_transposed, accumulate, a_strided;
  int64_t ldc_extra;
};

// Largest |local - contract| / sum_k |a_k b_k| over C, against the contract's
// bf16 GEMM on the same fp32 operands; also against the fp32 GEMM of the
// unrounded operands (*vs_fp32), which a bf16 product must be farther from.
double relative_gap(const Case& c, double* vs_fp32) {
  const int64_t lda = c.a_strided ? 2 * c.k : (c.a_transposed ? c.m : c.k);
  std::vector<float> a((size_t)(c.a_strided ? c.m * lda : c.m * c.k)), b((size_t)(c.k * c.n));
  for (size_t i = 0; i < a.size(); ++i) a[i] = ls::random_symmetric(11, ls::Purpose::kTest, i, 1.0f);
  for (size_t i = 0; i < b.size(); ++i) b[i] = ls::random_symmetric(12, ls::Purpose::kTest, i, 1.0f);
  const ls::ops::ConstMat A = c.a_strided ? ls::ops::ConstMat{a.data(), lda, 2}
                              : c.a_transposed ? ls::ops::ConstMat{a.data(), 1, c.m}
                                               : ls::ops::ConstMat{a.data(), c.k, 1};
  const ls::ops::ConstMat B = c.b_transposed ? ls::ops::ConstMat{b.data(), 1, c.k} : ls::ops::ConstMat{b.data(), c.n, 1};
  const int64_t ldc = c.n + c.ldc_extra;
  std::vector<float> start((size_t)(c.m * ldc));
  for (size_t i = 0; i < start.size(); ++i) start[i] = c.accumulate ? ls::random_symmetric(13, ls::Purpose::kTest, i, 4.0f) : 0.0f;
  std::vector<float> local = start, contract = start, fp32 = start;
  ls::ops::local::gemm_bf16(c.m, c.n, c.k, A, B, local.data(), ldc, c.accumulate);
  // The contract's right after oneDNN's on this thread: on AMX its path must load the tile configuration
  // oneDNN's kernels released (gemm_bf16.h, amx_tiles_clobbered), or its first tile op faults.
  ls::ops::gemm_bf16_rounded(c.m, c.n, c.k, A, B, contract.data(), ldc, c.accumulate, 1);
  ls::ops::gemm_naive(c.m, c.n, c.k, A, B, fp32.data(), ldc, c.accumulate);
  double worst = 0, worst_fp32 = 0;
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) {
      double scale = std::fabs((double)start[(size_t)(i * ldc + j)]);
      for (int64_t k = 0; k < c.k; ++k)
        scale += std::fabs((double)A.p[i * A.rs + k * A.cs] * B.p[k * B.rs + j * B.cs]);
      const size_t at = (size_t)(i * ldc + j);
      worst = std::max(worst, std::fabs((double)local[at] - contract[at]) / scale);
      worst_fp32 = std::max(worst_fp32, std::fabs((double)local[at] - fp32[at]) / scale);
    }
  for (int64_t i = 0; i < c.m; ++i)  // the columns past N are left alone
    for (int64_t j = c.n; j < ldc; ++j) CHECK(local[(size_t)(i * ldc + j)] == start[(size_t)(i * ldc + j)]);
  *vs_fp32 = worst_fp32;
  return worst;
}

}  // namespace

TEST_SUITE("local") {
  TEST_CASE("bf16 at the local level: oneDNN's matmul, within 1e-5 of the contract's bf16 GEMM") {
    if (!ls::ops::local::have_gemm_bf16()) {
      MESSAGE("this build has no oneDNN: the local level refuses bf16 (the next test case)");
      return;
    }
    CHECK(ls::ops::local::gemm_bf16_library().rfind("oneDNN ", 0) == 0);
    // Multiples of 32 (a primitive of its own) and not (oneDNN's run-time-shape primitive).
    const std::vector<Case> cases = {
        {64, 96, 256, false, false, false, false, 0},  // a layer's forward
        {37, 50, 129, false, false, false, false, 0},  // an expert's rows
        {96, 64, 160, true, false, false, false, 0},   // a weight gradient: A = X^T
        {45, 33, 71, true, false, true, false, 0},     // an expert's, accumulating across rounds
        {64, 32, 128, false, true, false, false, 0},   // an input gradient: B = W^T
        {30, 40, 64, false, true, true, false, 24},    // into a wider C (a tensor-parallel slice), accumulating
        {20, 24, 40, false, false, false, true, 0},    // neither of A's strides is 1
    };
    const int64_t calls = ls::ops::local::gemm_bf16_calls();
    for (const Case& c : cases) {
      CAPTURE(c.m);
      CAPTURE(c.n);
      CAPTURE(c.k);
      double vs_fp32 = 0;
      const double gap = relative_gap(c, &vs_fp32);
      // The same exact bf16 products summed in another order: a few fp32 roundings apart.
      CHECK(gap <= 1e-5);
      // And they are bf16's products: the fp32 GEMM of the unrounded operands is much farther.
      CHECK(vs_fp32 > 100 * gap);
      MESSAGE(c.m << "x" << c.n << "x" << c.k << ": |local - contract bf16| <= " << gap
                  << " x sum|ab|; |local - fp32| up to " << vs_fp32);
    }
    CHECK(ls::ops::local::gemm_bf16_calls() == calls + (int64_t)cases.size());  // oneDNN ran each
  }

  TEST_CASE("a bf16 run at the local level trains on oneDNN, near portable's bf16, bitwise run to run") {
    if (!ls::ops::local::have_gemm_bf16()) {
      const auto sc = lstest::write_temp("local_bf16.json", R"({"train": {"steps": 2}})");
      const lstest::CliResult r =
          lstest::run_cli("run " + sc.string() + " --set numerics.level=local --set numerics.precision=bf16");
      CHECK(r.rc == 2);
      CHECK(r.err.find("numerics.level=local with numerics.precision=bf16 needs oneDNN") != std::string::npos);
      return;
    }
    const int64_t calls = ls::ops::local::gemm_bf16_calls();
    const ls::RunResult l = train_bf16("local", 16, 1);
    CHECK(ls::ops::local::gemm_bf16_calls() > calls);  // the products ran on oneDNN
    CHECK(l.level == "local");
    CHECK(l.precision == "bf16");
    CHECK(l.local_gemm_bf16 == ls::ops::local::gemm_bf16_library());
    CHECK(ls::result_json(l).at("local_gemm_bf16") == l.local_gemm_bf16);
    REQUIRE(l.losses.size() == 16);
    for (float x : l.losses) CHECK(std::isfinite(x));
    CHECK(l.losses.back() < l.losses.front() - 0.5f);  // it learns (top2: 5.5 -> ~4.3 nats/byte)
    const ls::RunResult portable = train_bf16("portable", 16, 1), fp32 = train_bf16("local", 16, 1, "fp32");
    CHECK(l.final_state_hash != fp32.final_state_hash);      // bf16 products, not fp32's
    CHECK(l.final_state_hash != portable.final_state_hash);  // oneDNN's order, not the contract's
    // The same bf16 operands summed in another order: step 1 within 1e-5
    // relative (measured 2e-7), every step within 1e-3 (measured 2e-4).
    double worst = 0;
    for (size_t i = 0; i < l.losses.size(); ++i)
      worst = std::max(worst, std::fabs((double)l.losses[i] - portable.losses[i]) / portable.losses[i]);
    CHECK(std::fabs((double)l.losses[0] - portable.losses[0]) <= 1e-5 * portable.losses[0]);
    CHECK(worst <= 1e-3);
    MESSAGE("local bf16 vs portable bf16, top2 16 steps: max relative loss difference " << worst);
    // At a fixed thread count the same bits every run, whichever pool thread ran an expert.
    const std::string two = train_bf16("local", 8, 2).final_state_hash;
    CHECK(train_bf16("local", 8, 2).final_state_hash == two);
    CHECK(train_bf16("local", 8, 2).final_state_hash == two);
  }
}
