// MoE rounds (docs/MOE.md): the plan, the leaf tree carried across rounds,
// and whole runs whose executions differ (rounds, borrowed slots, GEMM
// calls, all-to-alls, buffer sizes) while every bit stays the reference's.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "contract.h"
#include "model/experts.h"
#include "ops/gemm.h"
#include "ops/leaf_fold.h"
#include "ops/ops.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "tiny_scenario.h"

namespace {

const std::string kTinySkewed = lstest::tiny_scenario(true);

struct Outcome {
  std::string hash;
  std::vector<std::string> loss_bits;
  ls::RunResult result;
  std::string executed;  // what ran: rounds, borrowed, calls, exchanges, buffer bytes
};

Outcome run(std::vector<std::string> sets, int threads = 2, ls::Backend backend = ls::Backend::kEngine) {
  ls::Scenario s = ls::scenario_from_json(nlohmann::json::parse(kTinySkewed), "tiny.json", sets);
  ls::RunOptions opt;
  opt.threads = threads;
  opt.backend = backend;
  opt.eval = false;
  Outcome o;
  o.result = ls::run_scenario(s, opt);
  omp_set_num_threads(omp_get_num_procs());
  o.hash = o.result.final_state_hash;
  for (float l : o.result.losses) o.loss_bits.push_back(ls::hex_bits(l));
  const ls::RunResult& r = o.result;
  for (size_t i = 0; i < r.moe_rounds.size(); ++i)
    o.executed += std::to_string(r.moe_rounds[i]) + "/" + std::to_string(r.moe_borrowed[i]) + "/" +
                  std::to_string(r.moe_gemm_calls[i]) + "/" + std::to_string(r.moe_all_to_all_calls[i]) + " ";
  o.executed += std::to_string(r.peak_expert_bytes);
  return o;
}

// Each expert's rows covered once, in order, by its segments over the
// rounds (one per round); no slot used twice in a round; every segment
// inside its group's slots; rows past the capacity counted as borrowed.
void check_plan(const ls::RoundPlan& p, const std::vector<int64_t>& load, int group, bool drop) {
  const int n = (int)load.size();
  std::vector<int64_t> next(n, 0);
  int64_t borrowed = 0;
  for (const auto& segs : p.round) {
    std::vector<int> used(p.slots, 0), seen(n, 0);
    for (const ls::Segment& s : segs) {
      REQUIRE(s.rows > 0);
      CHECK(seen[s.expert]++ == 0);
      CHECK(s.first == next[s.expert]);
      next[s.expert] += s.rows;
      const int g0 = s.expert / group * group, g1 = std::min(n, g0 + group);
      CHECK(s.slot >= g0 * p.capacity);
      CHECK(s.slot + s.rows <= g1 * p.capacity);
      borrowed += std::max<int64_t>(0, s.rows - p.capacity);
      for (int64_t k = s.slot; k < s.slot + s.rows; ++k) CHECK(used[k]++ == 0);
    }
  }
  CHECK(borrowed == p.borrowed);
  for (int e = 0; e < n; ++e) CHECK(next[e] + (drop ? std::max<int64_t>(0, load[e] - p.capacity) : 0) == load[e]);
}

struct PathGuard {
  ~PathGuard() { ls::ops::set_gemm_path(ls::ops::GemmPath::kAuto); }
};

}  // namespace

TEST_SUITE("moe") {
  TEST_CASE("plan_rounds: every row once, in order, slots disjoint, lending within the group") {
    ls::ModelConfig c;
    c.experts = 8;
    c.top_k = 2;
    uint64_t seed = 1;
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<int64_t> load(8);
      for (int e = 0; e < 8; ++e) load[e] = (int64_t)(ls::random_unit(seed, ls::Purpose::kTest, trial * 8 + e) * (e < 2 ? 90 : 20));
      for (int group : {1, 2, 4, 8})
        for (bool borrow : {false, true})
          for (int cap : {1, 5, 16}) {
            c.moe_capacity = cap;
            c.moe_group_size = group;
            c.moe_borrow = borrow;
            c.moe_policy = ls::MoePolicy::kRounds;
            const ls::RoundPlan p = ls::plan_rounds(c, load, 64);
            CHECK(p.slots == cap * 8);
            check_plan(p, load, group, false);
            const int64_t busiest = *std::max_element(load.begin(), load.end());
            if (!borrow) CHECK(p.rounds() == (busiest + cap - 1) / cap);
            else CHECK(p.rounds() <= (busiest + cap - 1) / cap);
          }
      c.moe_policy = ls::MoePolicy::kPeak;
      const ls::RoundPlan peak = ls::plan_rounds(c, load, 64);
      CHECK(peak.rounds() <= 1);
      CHECK(peak.slots == 8 * *std::max_element(load.begin(), load.end()));
      check_plan(peak, load, 8, false);
      c.moe_policy = ls::MoePolicy::kDrop;
      c.moe_capacity = 5;
      const ls::RoundPlan drop = ls::plan_rounds(c, load, 64);
      check_plan(drop, load, 8, true);
    }
  }

  TEST_CASE("plan_rounds: borrowing, worked example") {
    ls::ModelConfig c;
    c.experts = 4;
    c.moe_capacity = 2;
    // Expert 0 overflows by 3; expert 1 leaves 1 slot, expert 2 both.
    const std::vector<int64_t> load = {5, 1, 0, 2};
    ls::RoundPlan p = ls::plan_rounds(c, load, 0);
    REQUIRE(p.rounds() == 1);
    CHECK(p.borrowed == 3);
    const std::vector<ls::Segment>& r0 = p.round[0];
    REQUIRE(r0.size() == 3);
    auto same = [](const ls::Segment& s, int e, int64_t first, int64_t rows, int64_t slot) {
      return s.expert == e && s.first == first && s.rows == rows && s.slot == slot;
    };
    // Side by side: expert 0 in its 2 slots and the 3 that experts 1 and 2 leave empty.
    CHECK(same(r0[0], 0, 0, 5, 0));
    CHECK(same(r0[1], 1, 0, 1, 5));
    CHECK(same(r0[2], 3, 0, 2, 6));
    c.moe_borrow = false;
    p = ls::plan_rounds(c, load, 0);
    CHECK(p.rounds() == 3);
    CHECK(p.borrowed == 0);
    c.moe_borrow = true;
    c.moe_group_size = 2;  // expert 0 may only borrow from expert 1
    p = ls::plan_rounds(c, load, 0);
    CHECK(p.rounds() == 2);
    CHECK(p.borrowed == 1);
    REQUIRE(p.round[0].size() == 3);
    CHECK(same(p.round[0][0], 0, 0, 3, 0));
    CHECK(same(p.round[0][1], 1, 0, 1, 3));
    CHECK(same(p.round[0][2], 3, 0, 2, 4));  // group {2, 3} starts at slot 2 x 2
    REQUIRE(p.round[1].size() == 1);
    CHECK(same(p.round[1][0], 0, 3, 2, 0));
  }

  TEST_CASE("plan_rounds: a capacity needing more than 4096 rounds is refused, naming the keys") {
    ls::ModelConfig c;
    c.experts = 2;
    c.moe_capacity = 1;
    c.moe_borrow = false;
    CHECK_NOTHROW(ls::plan_rounds(c, {4096, 0}, 0));
    try {
      ls::plan_rounds(c, {4097, 3}, 0);
      FAIL("accepted");
    } catch (const ls::UserError& e) {
      CHECK(std::string(e.what()).find("moe.capacity") != std::string::npos);
      CHECK(std::string(e.what()).find("4096") != std::string::npos);
    }
  }

  TEST_CASE("LeafFold fed in pieces equals one weight_grad over all rows, bitwise, on every GEMM path") {
    PathGuard guard;
    std::vector<ls::ops::GemmPath> paths = {ls::ops::GemmPath::kScalar};
    if (ls::ops::gemm_path_supported(ls::ops::GemmPath::kAvx2)) paths.push_back(ls::ops::GemmPath::kAvx2);
    if (ls::ops::gemm_path_supported(ls::ops::GemmPath::kAvx512)) paths.push_back(ls::ops::GemmPath::kAvx512);
    const int in = 13, out = 37;
    const int64_t rows = 90, leaves = 11;
    std::vector<float> X(rows * in), dY(rows * out);
    for (size_t i = 0; i < X.size(); ++i) X[i] = ls::random_symmetric(3, ls::Purpose::kTest, i, 1.0f);
    for (size_t i = 0; i < dY.size(); ++i) dY[i] = ls::random_symmetric(4, ls::Purpose::kTest, i, 1.0f);
    // Leaves 0, 4 and 10 empty; the rest uneven.
    std::vector<int64_t> leaf(rows);
    const int64_t cuts[] = {0, 0, 7, 19, 30, 30, 51, 60, 61, 75, 90, 90};
    for (int64_t lf = 0; lf < leaves; ++lf)
      for (int64_t r = cuts[lf]; r < cuts[lf + 1]; ++r) leaf[r] = lf;
    std::vector<int64_t> off(cuts, cuts + leaves + 1);
    for (ls::ops::GemmPath path : paths) {
      CAPTURE(ls::ops::path_name(path));
      ls::ops::set_gemm_path(path);
      std::vector<float> want(in * out);
      ls::ops::weight_grad(X.data(), in, dY.data(), out, in, out, off.data(), leaves, want.data());
      for (int64_t piece : {1, 3, 8, 29, 90}) {
        CAPTURE(piece);
        ls::ops::DeviceVector<float> state;
        std::vector<float> got(in * out, 7.0f);
        ls::ops::LeafFold fold;
        fold.begin(in, out, leaves, &state);
        for (int64_t r = 0; r < rows; r += piece) {
          const int64_t n = std::min(piece, rows - r);
          fold.add(&X[r * in], in, &dY[r * out], out, &leaf[r], n);
        }
        fold.finish(got.data());
        CHECK(std::memcmp(got.data(), want.data(), sizeof(float) * want.size()) == 0);
      }
    }
  }

  TEST_CASE("rounds at every capacity, borrowing, group size, peak, mesh and thread count: the reference's bits") {
    const Outcome ref = run({}, 1, ls::Backend::kReference);
    const std::vector<std::pair<std::vector<std::string>, int>> cases = {
        {{}, 2},
        {{"moe.capacity_factor=4"}, 2},
        {{"moe.capacity_factor=2"}, 1},
        {{"moe.capacity_factor=0.5"}, 2},
        {{"moe.capacity_factor=0.25"}, 2},
        {{"moe.capacity_factor=0.25", "moe.borrow=false"}, 2},
        {{"moe.capacity_factor=0.125"}, 4},
        {{"moe.capacity_factor=0.125", "moe.borrow=false"}, 2},
        {{"moe.capacity=1"}, 2},
        {{"moe.capacity=1", "moe.borrow=false"}, 1},
        {{"moe.capacity=3", "moe.group_size=2"}, 2},
        {{"moe.capacity_factor=0.25", "moe.group_size=1"}, 2},
        {{"moe.capacity_factor=0.25", "moe.group_size=4"}, 3},
        {{"moe.policy=peak"}, 2},
        {{"moe.policy=peak"}, 1},
        {{"mesh.dp=2", "mesh.ep=2", "moe.capacity_factor=0.25"}, 2},
        {{"mesh.dp=4", "mesh.ep=4", "moe.capacity=1"}, 2},
        {{"mesh.dp=4", "mesh.ep=4", "moe.policy=peak"}, 2},
        {{"mesh.dp=4", "mesh.ep=2", "mesh.fsdp=true", "moe.capacity_factor=0.5", "moe.borrow=false"}, 2},
        {{"mesh.dp=8", "mesh.ep=8", "moe.capacity_factor=0.125"}, 2},
        {{"mesh.dp=2", "mesh.fsdp=true", "moe.policy=peak"}, 1},
        {{"mesh.dp=4", "mesh.ep=4", "moe.capacity=2", "moe.group_size=1"}, 4},
    };
    std::set<std::string> executions;
    std::map<std::string, Outcome> by_name;
    for (const auto& [sets, threads] : cases) {
      std::string name;
      for (const std::string& s : sets) name += s + " ";
      name += "threads=" + std::to_string(threads);
      CAPTURE(name);
      Outcome o = run(sets, threads);
      CHECK(o.hash == ref.hash);
      CHECK(o.loss_bits == ref.loss_bits);
      executions.insert(o.executed);
      by_name[name] = o;
    }
    // The executions really differed.
    MESSAGE("distinct executions: " << executions.size() << " of " << cases.size() << " runs");
    CHECK(executions.size() >= cases.size() - 3);
    const ls::RunResult& small = by_name["moe.capacity_factor=0.25 threads=2"].result;
    const ls::RunResult& small_nb = by_name["moe.capacity_factor=0.25 moe.borrow=false threads=2"].result;
    const ls::RunResult& peak = by_name["moe.policy=peak threads=2"].result;
    const ls::RunResult& one_row = by_name["mesh.dp=4 mesh.ep=4 moe.capacity=1 threads=2"].result;
    const ls::RunResult& ep_peak = by_name["mesh.dp=4 mesh.ep=4 moe.policy=peak threads=2"].result;
    CHECK(small.moe_rounds[0] >= 4);
    CHECK(small.moe_borrowed[0] > 0);
    CHECK(small.moe_rounds[0] < small_nb.moe_rounds[0]);  // borrowing needs fewer rounds
    CHECK(peak.moe_rounds[0] == 1);
    CHECK(peak.peak_expert_bytes > 2 * small.peak_expert_bytes);
    CHECK(small.moe_gemm_calls[0] > peak.moe_gemm_calls[0]);
    // Per-round exchanges: 2 metadata all-to-alls per layer, then 4 per round (x out, y back, dy out, dx back).
    const int64_t ranks = 4, layers = 2;
    CHECK(ep_peak.moe_all_to_all_calls[0] == ranks * layers * (2 + 4 * 1));
    CHECK(one_row.moe_all_to_all_calls[0] > ranks * layers * (2 + 4 * 4));
    CHECK(one_row.moe_all_to_all_bytes[0] > 0);
  }

  TEST_CASE("the expert slots are sized by the capacity, not the load; peak by the busiest expert") {
    // One rank, 8 experts: slots = capacity x 8 rows of x (d_model 16) and
    // the SwiGLU parts act, dact, du, dv (d_ff 8); y, dy and dx stay in the
    // dispatch rows. With expert parallelism the slots hold y, dy, dx too.
    const int64_t row_bytes = (16 + 4 * 8) * 4, ep_row_bytes = (4 * 16 + 4 * 8) * 4;
    for (int cap : {1, 3, 7}) {
      CAPTURE(cap);
      const Outcome o = run({"moe.capacity=" + std::to_string(cap)});
      CHECK(o.result.peak_expert_bytes == cap * 8 * row_bytes);
      CHECK(o.result.peak_dispatch_bytes == 0);
    }
    const Outcome peak = run({"moe.policy=peak"});
    CHECK(peak.result.peak_expert_bytes % (8 * row_bytes) == 0);
    CHECK(peak.result.peak_expert_bytes / (8 * row_bytes) > 16);  // the busiest expert, over the mean load 16
    const Outcome ep = run({"mesh.dp=2", "mesh.ep=2", "moe.capacity=2"});
    CHECK(ep.result.peak_expert_bytes == 2 * 4 * ep_row_bytes);        // 4 experts per rank
    CHECK(ep.result.peak_dispatch_bytes == 2 * (2 * 2 * 4) * 16 * 4);  // send + receive: both owners' slots
  }

  TEST_CASE("drop differs from the dropless policies, and says how many rows it dropped") {
    const Outcome ref = run({});
    const Outcome drop = run({"moe.policy=drop", "moe.capacity_factor=0.5"});
    CHECK(drop.hash != ref.hash);
    CHECK(drop.result.moe_dropped[0] > 0);
    CHECK(drop.result.moe_rounds[0] == 1);
  }
}
