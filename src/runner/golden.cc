#include "runner/golden.h"

#include <algorithm>
#include <map>

#include "common/error.h"
#include "contract.h"

namespace ls {

std::vector<int> golden_hash_steps(int steps) {
  std::vector<int> out;
  const int every = std::max(1, steps / 4);
  for (int s = every; s < steps; s += every) out.push_back(s);
  if (steps > 0) out.push_back(steps);
  return out;
}

std::string golden_refusal(const std::string& level) {
  if (level != "local") return "";
  return "numerics.level=local: a local run is bitwise only run to run at a fixed thread count and mesh, so golden "
         "files hold portable runs only (compare local against portable by tolerance: docs/NUMERICS.md section 8)";
}

nlohmann::json make_golden(const std::string& scenario_path, const RunResult& r) {
  if (!golden_refusal(r.level).empty()) throw UserError(golden_refusal(r.level));
  nlohmann::json g;
  g["format"] = "lockstep-golden-1";
  g["scenario"] = scenario_path;
  g["name"] = r.scenario;
  g["fingerprint"] = r.fingerprint;
  g["steps"] = r.steps;
  const nlohmann::json summary = result_json(r);  // the same loss_bits and state_hashes as --json prints
  g["loss_bits"] = summary["loss_bits"];
  g["state_hashes"] = summary["state_hashes"];
  g["final_state_hash"] = r.final_state_hash;
  return g;
}

nlohmann::json GoldenMismatch::to_json() const {
  return {{"step", step}, {"field", field}, {"golden", golden}, {"now", now}, {"message", message}};
}

GoldenMismatch golden_mismatch(const nlohmann::json& g, const RunResult& r) {
  GoldenMismatch m;
  if (!golden_refusal(r.level).empty()) {
    m.field = "level";
    m.golden = "portable";
    m.now = r.level;
    m.message = golden_refusal(r.level);
    return m;
  }
  if (g.value("fingerprint", "") != r.fingerprint) {
    m.field = "fingerprint";
    m.golden = g.value("fingerprint", "?");
    m.now = r.fingerprint;
    m.message = "scenario fingerprint differs (golden " + m.golden + ", now " + r.fingerprint +
                "): the scenario file changed; regenerate with `lockstep golden` if that was intended";
    return m;
  }
  const auto& bits = g.at("loss_bits");
  const size_t n = std::min(bits.size(), r.losses.size());
  for (size_t i = 0; i < n; ++i) {
    const std::string want = bits[i].get<std::string>(), got = hex_bits(r.losses[i]);
    if (want != got) {
      const float wf = from_bits((uint32_t)std::stoul(want, nullptr, 16));
      m.step = (int)i + 1;
      m.field = "loss_bits";
      m.golden = want;
      m.now = got;
      m.message = "step " + std::to_string(i + 1) + ": loss_bits differ: golden " + want + " (" + std::to_string(wf) +
                  "), now " + got + " (" + std::to_string(r.losses[i]) + ")";
      return m;
    }
  }
  if (bits.size() != r.losses.size()) {
    m.field = "steps";
    m.golden = std::to_string(bits.size());
    m.now = std::to_string(r.losses.size());
    m.message = "steps differ: golden has " + m.golden + ", run has " + m.now;
    return m;
  }
  std::map<int, std::string> want;  // in step order (the JSON object holds them in key-text order)
  for (auto& [step, h] : g.at("state_hashes").items()) want[std::stoi(step)] = h.get<std::string>();
  for (auto& [step, h] : want) {
    auto it = r.state_hashes.find(step);
    const std::string got = it == r.state_hashes.end() ? "(not recorded)" : it->second;
    if (got != h) {
      m.step = step;
      m.field = "state_hash";
      m.golden = h;
      m.now = got;
      m.message = "step " + std::to_string(step) + ": state_hash differs: golden " + h + ", now " + got;
      return m;
    }
  }
  if (g.at("final_state_hash").get<std::string>() != r.final_state_hash) {
    m.step = r.steps;
    m.field = "final_state_hash";
    m.golden = g.at("final_state_hash").get<std::string>();
    m.now = r.final_state_hash;
    m.message = "final_state_hash differs: golden " + m.golden + ", now " + r.final_state_hash;
  }
  return m;
}

std::string compare_golden(const nlohmann::json& g, const RunResult& r) { return golden_mismatch(g, r).message; }

}  // namespace ls
