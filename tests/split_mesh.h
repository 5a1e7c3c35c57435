// The scenario the tensor-parallel and pipeline suites train, and their run
// helpers: 2 layers, 4 heads, a shared expert, 4 experts top-2 at capacity
// factor 0.5 (several rounds), skewed routing and the aux and z losses --
// every split the model has (heads, hidden features, 6 pipeline units) and
// rounds -- at 8 samples of 8 bytes, 3 steps.
#pragma once

#include <omp.h>

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

inline std::vector<std::string> loss_bits(const ls::RunResult& r) {
  std::vector<std::string> out;
  for (float l : r.losses) out.push_back(ls::hex_bits(l));
  return out;
}

}  // namespace lstest
