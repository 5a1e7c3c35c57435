// The `local` numerics level (docs/NUMERICS.md section 8): an ordinary fast
// trainer's numerics, held to `portable` by tolerance, bitwise only run to
// run at a fixed thread count and mesh (tracing it changes no bit), refused
// by the golden gate.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ckpt/checkpointer.h"
#include "ckpt/safetensors.h"
#include "cli_run.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "common/numerics_level.h"
#include "contract.h"
#include "faults/fault_spec.h"
#include "ops/local.h"
#include "runner/data_lanes.h"
#include "runner/golden.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "store/store.h"
#include "trace/diff.h"
#include "tiny_scenario.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = LOCKSTEP_SOURCE_DIR;

ls::RunResult train(const std::string& level, int steps, int threads, std::vector<std::string> sets = {},
                    const std::string& ckpt = "", const std::function<void(ls::RunOptions&)>& options = {}) {
  sets.push_back("numerics.level=" + level);
  sets.push_back("train.steps=" + std::to_string(steps));
  if (!ckpt.empty()) {
    sets.push_back("ckpt.url=" + ckpt);
    sets.push_back("ckpt.every=" + std::to_string(steps));
    sets.push_back("ckpt.async=false");
  }
  ls::Scenario s = ls::load_scenario((kRoot / "scenarios/top2.json").string(), sets);
  ls::RunOptions opt;
  opt.threads = threads;
  opt.eval = false;
  if (options) options(opt);
  return ls::run_scenario(s, opt);
}

// "40b1040c": a loss's bits as the trace and the summary write them.
std::string hex_bits(float v) {
  char b[9];
  std::snprintf(b, sizeof b, "%08x", (unsigned)ls::bits(v));
  return b;
}

// Every step's loss within the stated bound of portable's (docs/NUMERICS.md section 8).
void check_close(const ls::RunResult& local, const ls::RunResult& portable) {
  REQUIRE(local.losses.size() == portable.losses.size());
  for (size_t i = 0; i < portable.losses.size(); ++i) {
    CAPTURE(i);
    CHECK(std::fabs((double)local.losses[i] - portable.losses[i]) <= 1e-4 * std::fabs((double)portable.losses[i]));
  }
}

// local on `mesh` against portable there: its level, every loss close, and
// bitwise run to run; `other`, a second mesh of the same axis, moves its bits.
struct LocalOnMesh {
  ls::RunResult portable, local;
};
LocalOnMesh check_local_on_mesh(const std::vector<std::string>& mesh, const std::vector<std::string>& other) {
  LocalOnMesh r{train("portable", 16, 2, mesh), train("local", 16, 2, mesh)};
  CHECK(r.local.level == "local");
  check_close(r.local, r.portable);
  CHECK(train("local", 16, 2, mesh).final_state_hash == r.local.final_state_hash);   // run to run, a fixed mesh
  CHECK(train("local", 16, 2, other).final_state_hash != r.local.final_state_hash);  // the mesh moves local's bits
  return r;
}

// The param/* tensors of the checkpoint of `step` in url, by name.
std::map<std::string, std::vector<float>> params_at(const std::string& url, int64_t step) {
  std::unique_ptr<ls::ObjectStore> store = ls::open_store(url, ls::StoreOptions{});
  const ls::Manifest m = ls::read_manifest(*store, step);
  std::map<std::string, std::vector<uint8_t>> objects;
  for (const ls::ManifestObject& o : m.objects) objects[o.key] = store->get(o.key);
  std::map<std::string, std::vector<float>> out;
  for (const ls::ManifestTensor& t : m.tensors) {
    if (t.name.rfind("param/", 0) != 0) continue;
    int64_t n = 1;
    for (int64_t d : t.global_shape) n *= d;
    std::vector<float>& data = out[t.name];
    data.assign((size_t)n, 0.0f);
    for (const ls::ManifestPiece& p : t.pieces) {
      const std::vector<uint8_t>& bytes = objects.at(p.object);
      const ls::SafetensorsView v = ls::parse_safetensors(bytes.data(), bytes.size(), p.object);
      const ls::StoredTensor* st = v.find(p.stored_name);
      REQUIRE(st != nullptr);
      std::memcpy(&data[(size_t)p.global_begin], bytes.data() + v.data_start + st->begin,
                  (size_t)(p.global_end - p.global_begin) * 4);
    }
  }
  return out;
}

// Distance in units in the last place: how many floats lie between a and b.
int64_t ulp_distance(float a, float b) {
  auto ordered = [](float x) {
    int32_t i;
    std::memcpy(&i, &x, 4);
    return i < 0 ? (int64_t)INT32_MIN - i : (int64_t)i;
  };
  return std::llabs(ordered(a) - ordered(b));
}

}  // namespace

TEST_SUITE("local") {
  TEST_CASE("contraction is allowed in the local translation unit only") {
    // As the contract suite: a = 1 + 2^-23, c = -(1 + 2^-22); fused, the 2^-46 survives.
    const float a = 1.0f + 0x1p-23f, c = -(1.0f + 0x1p-22f);
    CHECK(ls::ops::local::mul_add(a, a, c) == 0x1p-46f);  // local.cc: -ffp-contract=fast fused it
    volatile float va = a, vc = c;
    CHECK(va * va + vc == 0.0f);  // this (portable) unit: rounded twice
  }

  TEST_CASE("local follows portable within a stated bound over 50 steps, and really is another computation") {
    const fs::path dir = lstest::cli_temp_dir() / "local-tol";
    fs::remove_all(dir);
    const ls::RunResult p = train("portable", 50, 1, {}, (dir / "portable").string());
    const ls::RunResult l = train("local", 50, 1, {}, (dir / "local").string());
    CHECK(p.level == "portable");
    CHECK(l.level == "local");
    CHECK(ls::result_json(l)["level"] == "local");
    REQUIRE(p.losses.size() == 50);
    REQUIRE(l.losses.size() == 50);
    CHECK(p.final_state_hash != l.final_state_hash);  // the two levels really compute differently
    // The stated bounds: step 1 (same initial state, only rounding differs)
    // within 1e-6 relative; every one of the 50 steps within 1e-4.
    double worst = 0;
    int worst_step = 0, steps_differing = 0;
    for (int i = 0; i < 50; ++i) {
      const double rel = std::fabs((double)p.losses[i] - l.losses[i]) / std::fabs((double)p.losses[i]);
      if (rel > worst) worst = rel, worst_step = i + 1;
      steps_differing += p.losses[i] != l.losses[i];
    }
    CHECK(std::fabs((double)p.losses[0] - l.losses[0]) <= 1e-6 * std::fabs((double)p.losses[0]));
    CHECK(worst <= 1e-4);
    // Final weights: the largest distance in ulps, and how many differ.
    const auto wp = params_at((dir / "portable").string(), 50), wl = params_at((dir / "local").string(), 50);
    REQUIRE(wp.size() == wl.size());
    // Ulps mean little across zero (a weight near +0 in one run and -0 in
    // the other is billions of ulps apart): the max ulp is taken over weights
    // of magnitude >= 1e-3, beside the max absolute difference over all.
    int64_t max_ulp = 0, differ = 0, total = 0;
    double max_abs = 0;
    std::string where;
    for (const auto& [name, a] : wp) {
      const std::vector<float>& b = wl.at(name);
      REQUIRE(a.size() == b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        differ += a[i] != b[i];
        max_abs = std::max(max_abs, std::fabs((double)a[i] - b[i]));
        if (std::fabs(a[i]) < 1e-3f) continue;
        const int64_t d = ulp_distance(a[i], b[i]);
        if (d > max_ulp) max_ulp = d, where = name + "[" + std::to_string(i) + "]";
      }
      total += (int64_t)a.size();
    }
    CHECK(differ > 0);
    CHECK(max_abs < 1e-3);
    MESSAGE("local vs portable, top2 50 steps, 1 thread: max relative loss difference "
            << worst << " (step " << worst_step << "), " << steps_differing << "/50 steps differ in their bits; final "
            << "weights: " << differ << " of " << total << " differ, max |difference| " << max_abs << ", max "
            << max_ulp << " ulp among weights of magnitude >= 1e-3 (at " << where << ")");
  }

  // The usual way on a mesh, the baseline the invariant mesh's price is
  // measured against (tools/bench-cluster): tensor parallel folds each
  // rank's k-range from +0 and sums the partials (an all-reduce, a
  // reduce-scatter with sequence parallel) instead of chaining them.
  TEST_CASE("local on tensor- and data-parallel meshes: partials summed, not chained; close to portable") {
    const ls::RunResult portable = train("portable", 16, 2, {"mesh.tp=2", "mesh.dp=2"});
    const ls::RunResult one = train("local", 16, 2);
    for (const std::vector<std::string>& mesh :
         {std::vector<std::string>{"mesh.tp=2"}, {"mesh.tp=2", "mesh.dp=2"}, {"mesh.tp=2", "mesh.sp=true"},
          {"mesh.dp=2"}}) {
      CAPTURE(mesh[0]);
      CAPTURE(mesh.size());
      const ls::RunResult l = train("local", 16, 2, mesh);
      CHECK(l.level == "local");
      check_close(l, portable);
      if (mesh[0] != "mesh.tp=2") continue;
      // The chain's links are hand-offs (through shared memory here: the ranks are threads); the summed fold
      // hands none on, and its partials go by all-reduce or reduce-scatter.
      CHECK(portable.bytes_sent_per_step.count("shared_send"));
      CHECK(!l.bytes_sent_per_step.count("send"));
      CHECK(!l.bytes_sent_per_step.count("shared_send"));
      CHECK(l.final_state_hash != one.final_state_hash);  // the mesh moves local's bits
    }
  }

  TEST_CASE("local on a pipeline: the microbatches' gradients added in arrival order; close to portable") {
    const std::vector<std::string> pipe4 = {"mesh.pp=2", "train.microbatches=4"},
                                   pipe2 = {"mesh.pp=2", "train.microbatches=2"};
    // A running sum: the microbatch count moves local's bits.
    const LocalOnMesh r = check_local_on_mesh(pipe4, pipe2);
    REQUIRE(r.local.pipeline.size() == 2);  // really pipelined
    CHECK(train("portable", 16, 2, pipe2).final_state_hash == r.portable.final_state_hash);  // the tree does not
  }

  TEST_CASE("local on a context-parallel mesh: each rank's dK/dV partial from +0, summed by an all-reduce") {
    const std::vector<std::string> cp2 = {"mesh.cp=2"}, cp4 = {"mesh.cp=4", "mesh.cp_layout=contiguous"};
    const LocalOnMesh r = check_local_on_mesh(cp2, cp4);
    REQUIRE(r.local.context.size() == 2);  // really split
    // The chain's links are sends; the summed partials go by all-reduce and no link is sent.
    CHECK(r.portable.bytes_sent_per_step.count("send"));
    CHECK(!r.local.bytes_sent_per_step.count("send"));
    CHECK(r.local.context[0].link_messages == 0);
  }

  TEST_CASE("a run leaves the process portable, whatever its level") {
    train("local", 2, 1);
    CHECK(ls::numerics_level() == ls::NumericsLevel::kPortable);
  }

  TEST_CASE("local is bitwise run to run at a fixed thread count and mesh, and moves with the thread count") {
    const ls::RunResult a = train("local", 8, 2), b = train("local", 8, 2);
    CHECK(a.final_state_hash == b.final_state_hash);
    const ls::RunResult c = train("local", 8, 2, {"mesh.dp=2"}), d = train("local", 8, 2, {"mesh.dp=2"});
    CHECK(c.final_state_hash == d.final_state_hash);  // two ranks
    const ls::RunResult one = train("local", 8, 1);
    CHECK(one.final_state_hash != a.final_state_hash);  // the reductions follow the thread count
    // Portable, for contrast: one hash at every thread count and mesh.
    const ls::RunResult p1 = train("portable", 8, 1), p2 = train("portable", 8, 2, {"mesh.dp=2"});
    CHECK(p1.final_state_hash == p2.final_state_hash);
  }

  // The ranks' partials are added left to right in rank order, never in the
  // order they arrive (random delays in every collective reorder arrivals
  // here): three ranks or more are as reproducible as two. The gradient
  // norm's threads likewise add in thread order.
  TEST_CASE("local is bitwise run to run on dp 8 and tp 2 in one process, and at 4 threads; the mesh moves it") {
    auto jittered = [](uint64_t seed) { return [seed](ls::RunOptions& o) { o.jitter_seed = seed; }; };
    const std::vector<std::string> dp8 = {"mesh.dp=8"}, tp2 = {"mesh.tp=2"};
    const ls::RunResult a = train("local", 6, 2, dp8, "", jittered(1)), b = train("local", 6, 2, dp8, "", jittered(2)),
                        c = train("local", 6, 2, dp8, "", jittered(3));
    CHECK(a.final_state_hash == b.final_state_hash);
    CHECK(a.final_state_hash == c.final_state_hash);
    const ls::RunResult t1 = train("local", 6, 2, tp2, "", jittered(4)),
                        t2 = train("local", 6, 2, tp2, "", jittered(5));
    CHECK(t1.final_state_hash == t2.final_state_hash);
    const ls::RunResult four1 = train("local", 6, 4), four2 = train("local", 6, 4);
    CHECK(four1.final_state_hash == four2.final_state_hash);
    // Another mesh is another order: local's bits move with it (portable's do not).
    const ls::RunResult dp4 = train("local", 6, 2, {"mesh.dp=4"}, "", jittered(6));
    CHECK(dp4.final_state_hash != a.final_state_hash);
    CHECK(t1.final_state_hash != a.final_state_hash);
    CHECK(train("portable", 6, 2, dp8, "", jittered(7)).final_state_hash ==
          train("portable", 6, 2, {"mesh.dp=4"}, "", jittered(8)).final_state_hash);
  }

  // A trace must describe the run it watches: at 2 threads one rank runs in
  // data lanes (runner/data_lanes.h), and a traced run did not, which at this
  // level is another computation. Likewise a fault's phase hook.
  TEST_CASE("tracing a local run changes no bit, on one rank (data lanes) and on tp 2 x dp 2; nor does a fault hook") {
    const fs::path dir = lstest::cli_temp_dir() / "local-traced";
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::string one_rank_hash;
    for (const std::vector<std::string>& mesh : {std::vector<std::string>{}, {"mesh.tp=2", "mesh.dp=2"}}) {
      CAPTURE(mesh.size());
      const fs::path path = dir / ("mesh" + std::to_string(mesh.size()) + ".jsonl");
      const ls::RunResult plain = train("local", 4, 2, mesh);
      const ls::RunResult traced =
          train("local", 4, 2, mesh, "", [&](ls::RunOptions& o) { o.trace_path = path.string(); });
      CHECK(traced.final_state_hash == plain.final_state_hash);
      REQUIRE(traced.losses.size() == 4);
      REQUIRE(plain.losses.size() == 4);
      // The trace was written and holds this run: every step's tensors, loss bits and the final hash.
      REQUIRE(fs::exists(path));
      const ls::Trace t = ls::read_trace(path.string());
      REQUIRE(t.steps.size() == 4);
      CHECK(t.end.value("final_state_hash", "") == plain.final_state_hash);
      for (int i = 0; i < 4; ++i) {
        CAPTURE(i);
        CHECK(hex_bits(traced.losses[i]) == hex_bits(plain.losses[i]));
        CHECK(t.steps[i].value("loss_bits", "") == hex_bits(plain.losses[i]));
        int grads = 0, forward = 0;
        for (const nlohmann::json& r : t.tensors) {
          if (r.value("step", 0) != i + 1) continue;
          grads += r.value("phase", "") == "grad";
          forward += r.value("phase", "") == "fwd";
        }
        CHECK(grads > 0);
        CHECK(forward > 0);
      }
      if (mesh.empty()) one_rank_hash = plain.final_state_hash;
    }
    // The other way of using the threads (one model, each op split) really is other bits here:
    // a trace that took it would not describe the run.
    struct LanesOff {
      LanesOff() { ls::set_data_lanes_enabled(false); }
      ~LanesOff() { ls::set_data_lanes_enabled(true); }
    };
    std::string one_model_hash;
    {
      LanesOff off;
      one_model_hash = train("local", 4, 2).final_state_hash;
    }
    CHECK(one_model_hash != one_rank_hash);
    // A planted fault (a straggler: it slows, never changes a bit) installs the phase hook; the bits stay.
    const ls::RunResult slowed =
        train("local", 4, 2, {}, "", [](ls::RunOptions& o) { o.faults = {ls::parse_fault("straggler@2:slow=0.001")}; });
    CHECK(slowed.final_state_hash == one_rank_hash);
  }

  // Under mpirun the ranks' sums are Lockstep's own exchange (each block's
  // parts added in rank order), through shared memory or as messages: fixed
  // run to run at a mesh, as in one process.
  TEST_CASE("local under --launcher mpi is bitwise run to run at a fixed mesh, shared memory or messages") {
    if (!ls::mpi_available()) return;
    const fs::path sc = lstest::write_temp("local-mpi.json", lstest::tiny_scenario());
    auto hash = [&](const std::string& sets) {
      const lstest::CliResult r = lstest::run_cli("run " + sc.string() + " --launcher mpi --json --quiet --threads 1 "
                                                  "--set numerics.level=local --set mesh.dp=4 " + sets);
      CAPTURE(r.err);
      REQUIRE(r.rc == 0);
      CHECK(lstest::last_json(r.out).at("processes") == 4);
      return lstest::last_json(r.out).at("final_state_hash").get<std::string>();
    };
    const std::string shared = hash(""), messages = hash("--set mesh.shared_memory=false");
    CHECK(hash("") == shared);
    CHECK(hash("--set mesh.shared_memory=false") == messages);
    const lstest::CliResult dp2 = lstest::run_cli("run " + sc.string() + " --launcher mpi --json --quiet --threads 1 "
                                                  "--set numerics.level=local --set mesh.dp=2");
    REQUIRE(dp2.rc == 0);
    CHECK(lstest::last_json(dp2.out).at("final_state_hash") != shared);  // another mesh, another order
  }

  // What the key's help and the summary say must be what the tests above hold.
  TEST_CASE("the key's help and the summary's numerics line name OpenBLAS and claim only what holds") {
    const lstest::CliResult keys = lstest::run_cli("keys");
    REQUIRE(keys.rc == 0);
    CHECK(keys.out.find("Eigen GEMMs") == std::string::npos);
    CHECK(keys.out.find("(OpenBLAS sgemm, or Eigen in a build without OpenBLAS;") != std::string::npos);
    CHECK(keys.out.find("the same bits run to run at a fixed thread count and mesh, in one process or under "
                        "--launcher mpi") != std::string::npos);
    const auto sc =
        lstest::write_temp("local_summary.json", R"({"numerics": {"level": "local"}, "train": {"steps": 2}})");
    const lstest::CliResult run = lstest::run_cli("run " + sc.string() + " --threads 2");
    REQUIRE(run.rc == 0);
    CHECK(run.out.find("numerics        local: the same bits run to run at this thread count and mesh only; GEMMs by "
                       + ls::ops::local::gemm_library()) != std::string::npos);
  }

  TEST_CASE("--profile-ops times every kind of op and changes no bit") {
    ls::Scenario s = ls::load_scenario((kRoot / "scenarios/top2.json").string(), {"train.steps=4"});
    ls::RunOptions opt;
    opt.threads = 1;
    opt.eval = false;
    const ls::RunResult plain = ls::run_scenario(s, opt);
    opt.profile_ops = true;
    const ls::RunResult timed = ls::run_scenario(s, opt);
    CHECK(plain.final_state_hash == timed.final_state_hash);
    CHECK(plain.op_seconds.empty());
    CHECK(ls::result_json(timed).contains("op_seconds"));
    double sum = 0;
    for (const char* op : {"gemm", "weight_grad", "attention", "softmax", "norm", "swiglu", "moe_dispatch",
                           "moe_combine", "adamw", "grad_norm"}) {
      CAPTURE(op);
      REQUIRE(timed.op_seconds.count(op));
      CHECK(timed.op_seconds.at(op) > 0);  // every kind ran and was timed
      sum += timed.op_seconds.at(op);
    }
    // At one thread the timed ops are never more than the step (only the
    // outermost op on a thread counts). How much of it they cover is a
    // measurement, not a rule a unit test can hold on a shared machine (a
    // fresh process's first steps fault in their buffers outside any op):
    // tools/price-list prints it ("timed ops", per level).
    CHECK(sum <= timed.seconds * 1.05);
  }

  TEST_CASE("golden files refuse local runs, and say why") {
    const ls::RunResult l = train("local", 2, 1);
    CHECK_THROWS_WITH_AS(ls::make_golden("x.json", l), doctest::Contains("golden files hold portable runs only"),
                         ls::UserError);
    CHECK(ls::compare_golden(nlohmann::json::object(), l).find("numerics.level=local") != std::string::npos);
    const auto sc = lstest::write_temp("local_top2.json", R"({"numerics": {"level": "local"}, "train": {"steps": 2}})");
    const lstest::CliResult g = lstest::run_cli("golden " + sc.string() + " --golden-dir " +
                                                (lstest::cli_temp_dir() / "g").string());
    CHECK(g.rc == 2);
    CHECK(g.err.find("golden files hold portable runs only") != std::string::npos);
    CHECK(!fs::exists(lstest::cli_temp_dir() / "g" / "local_top2.json"));
    const lstest::CliResult bad = lstest::run_cli("run " + sc.string() + " --set numerics.level=fast");
    CHECK(bad.rc == 2);
    CHECK(bad.err.find("numerics.level") != std::string::npos);
    const lstest::CliResult ref = lstest::run_cli("run " + sc.string() + " --backend reference");
    CHECK(ref.rc == 2);
    CHECK(ref.err.find("reference") != std::string::npos);
  }
}
