// Golden checksums: per-step loss bits and state hashes of a scenario, stored
// in golden/<name>.json, written by `lockstep golden`, held by `lockstep check`.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runner/runner.h"

namespace ls {

// Steps (1-based) whose state hash a golden file records: every quarter of
// the run and the last step.
std::vector<int> golden_hash_steps(int steps);

// Why a run at this numerics level cannot have or be checked against a
// golden file ("" for portable).
std::string golden_refusal(const std::string& level);

// The golden document for a finished run (throws UserError for a local run). scenario_path is stored as given
// (relative to the repository root by convention).
nlohmann::json make_golden(const std::string& scenario_path, const RunResult& r);

// The first difference between a run and its golden document, for reports
// (check's text, --json and --junit).
struct GoldenMismatch {
  int step = 0;        // 1-based; 0 when the field is not per step (fingerprint, steps, level)
  std::string field;   // "loss_bits", "state_hash", "final_state_hash", "fingerprint", "steps" or "level"
  std::string golden, now;  // both values as text
  std::string message;      // one line naming the step, the field and both values; empty: no difference
  bool differs() const { return !message.empty(); }
  nlohmann::json to_json() const;  // {step, field, golden, now, message}
};
GoldenMismatch golden_mismatch(const nlohmann::json& golden, const RunResult& r);

// "" when r matches the golden document bit for bit; otherwise a message
// naming the first step and field that differ, with both values.
std::string compare_golden(const nlohmann::json& golden, const RunResult& r);

}  // namespace ls
