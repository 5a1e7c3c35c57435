// The scenario the tensor-parallel and pipeline suites train, and their run
// helpers: 2 layers, 4 heads, a shared expert, 4 experts top-2 at capacity
// factor 0.5 (several rounds), skewed routing and the aux and z losses --
// every split the model has (heads, hidden features, 6 pipeline units) and
// rounds -- at 8 samples of 8 bytes, 3 steps.
#pragma once

#include <omp.h>

#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "cli_run.h"

#include "contract.h"
#include "runner/runner.h"
#include "runner/scenario.h"

namespace lstest {

inline const char* kSplitScenario = R"({"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 8, "d_ff": 16,
  "shared_expert": true},
  "moe": {"experts": 4, "top_k": 2, "aux_loss_weight": 0.05, "z_loss_weight": 0.01, "capacity_factor": 0.5,
          "router_skew": 1.0},
  "train": {"steps": 3, "batch": 8, "warmup_steps": 1, "eval_every": 0, "eval_batches": 1},
  "data": {"synthetic_bytes": 8192}})";

inline ls::Scenario split_scenario(const std::vector<std::string>& sets) {
  return ls::scenario_from_json(nlohmann::json::parse(kSplitScenario), "split.json", sets);
}

// A run in this process (no evaluation); OpenMP's thread count is put back after.
inline ls::RunResult run_split(const std::vector<std::string>& sets, int threads = 2,
                               ls::Backend backend = ls::Backend::kEngine) {
  ls::RunOptions opt;
  opt.threads = threads;
  opt.backend = backend;
  opt.eval = false;
  ls::RunResult r = ls::run_scenario(split_scenario(sets), opt);
  omp_set_num_threads(omp_get_num_procs());
  return r;
}

// `lockstep run FILE --quiet SETS` exits 2 with a message holding SAYS, for each (SETS, SAYS).
inline void check_refused(const std::string& file, const std::vector<std::pair<std::string, std::string>>& cases) {
  for (const auto& [sets, says] : cases) {
    CAPTURE(sets);
    const auto r = run_cli("run " + file + " --quiet " + sets);
    CAPTURE(r.err);
    CHECK(r.rc == 2);
    CHECK(r.err.find(says) != std::string::npos);
  }
}

// `lockstep faults sweep FILE` of 3 trials ends every trial on the golden hash.
inline void check_sweep_on_golden(const std::string& file, const std::string& sets, int seed) {
  const auto sweep = run_cli("faults sweep " + file + " --trials 3 --seed " + std::to_string(seed) + sets);
  CAPTURE(sweep.out);
  CHECK(sweep.rc == 0);
  CHECK(sweep.out.find("ended on the golden hash       3") != std::string::npos);
}

// A checkpoint of `sc` saved at step 3 on `saved_mesh` (--set words)
// resumes to step 6 on each of `meshes` on the uninterrupted run's hash,
// every object of it read once; `also` checks more of each resumed
// summary. Returns the checkpoint's directory.
inline std::filesystem::path check_resumes_on_hash(const std::string& sc, const std::string& saved_mesh,
                                                   const std::vector<std::string>& meshes, const std::string& tag,
                                                   const std::function<void(const nlohmann::json&)>& also = {}) {
  // Six steps in all (--steps never goes past train.steps): saved at 3, resumed to 6.
  const std::string six = " --set train.steps=6";
  const auto whole = run_cli("run " + sc + " --json --quiet" + six);
  REQUIRE(whole.rc == 0);
  const std::string hash = last_json(whole.out).at("final_state_hash");
  CAPTURE(saved_mesh);
  const auto ck = fresh_dir(tag);
  const auto saved = run_cli("run " + sc + six + " --json --quiet --steps 3 " + saved_mesh +
                             " --set ckpt.every=3 --set ckpt.url=" + ck.string());
  CAPTURE(saved.err);
  REQUIRE(saved.rc == 0);
  for (const std::string& mesh : meshes) {
    CAPTURE(mesh);
    const auto r = run_cli("run " + sc + six + " --json --quiet " + mesh + " --resume " + ck.string());
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    const nlohmann::json j = last_json(r.out);
    CHECK(j.at("final_state_hash") == hash);
    // The read-once restore: every object read once, whatever the mesh reads it into.
    CHECK(j.at("restore").at("store_bytes_read") == j.at("restore").at("checkpoint_bytes"));
    if (also) also(j);
  }
  return ck;
}

// A supervised job of `sc` for 6 steps on `mesh` (--set words), a
// checkpoint every 2 steps, with `faults` (--fault words) injected: it ends
// on the uninterrupted run's hash, the first restart after a rank crash,
// and `faults sweep` of 3 trials on that mesh holds the hash too. Returns
// the job's summary.
inline nlohmann::json check_survives_rank_crash(const std::string& sc, const std::string& mesh,
                                                const std::string& faults, const std::string& tag, int sweep_seed) {
  const auto whole = run_cli("run " + sc + " --json --quiet --set train.steps=6");
  REQUIRE(whole.rc == 0);
  const std::string hash = last_json(whole.out).at("final_state_hash");
  const auto ck = fresh_dir(tag);
  const std::string sets = " --set train.steps=6 " + mesh + " --set ckpt.every=2 --set ckpt.url=" + ck.string();
  const auto r = run_cli("run " + sc + sets + " --json --quiet " + faults);
  CAPTURE(r.err);
  REQUIRE(r.rc == 0);
  const nlohmann::json j = last_json(r.out);
  CHECK(j.at("final_state_hash") == hash);
  REQUIRE(j.at("restarts").size() >= 1);
  CHECK(j.at("restarts")[0].at("failure") == "exit 86 (a rank crashed)");
  check_sweep_on_golden(sc, sets, sweep_seed);
  return j;
}

inline std::vector<std::string> loss_bits(const ls::RunResult& r) {
  std::vector<std::string> out;
  for (float l : r.losses) out.push_back(ls::hex_bits(l));
  return out;
}

}  // namespace lstest
