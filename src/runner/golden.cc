#include "runner/golden.h"

#include <algorithm>

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

std::string compare_golden(const nlohmann::json& g, const RunResult& r) {
  if (!golden_refusal(r.level).empty()) return golden_refusal(r.level);
  if (g.value("fingerprint", "") != r.fingerprint)
    return "scenario fingerprint differs (golden " + g.value("fingerprint", "?") + ", now " + r.fingerprint +
           "): the scenario file changed; regenerate with `lockstep golden` if that was intended";
  const auto& bits = g.at("loss_bits");
  const size_t n = std::min(bits.size(), r.losses.size());
  for (size_t i = 0; i < n; ++i) {
    const std::string want = bits[i].get<std::string>(), got = hex_bits(r.losses[i]);
    if (want != got) {
      const float wf = from_bits((uint32_t)std::stoul(want, nullptr, 16));
      return "step " + std::to_string(i + 1) + ": loss_bits differ: golden " + want + " (" + std::to_string(wf) +
             "), now " + got + " (" + std::to_string(r.losses[i]) + ")";
    }
  }
  if (bits.size() != r.losses.size())
    return "steps differ: golden has " + std::to_string(bits.size()) + ", run has " + std::to_string(r.losses.size());
  for (auto& [step, h] : g.at("state_hashes").items()) {
    auto it = r.state_hashes.find(std::stoi(step));
    const std::string got = it == r.state_hashes.end() ? "(not recorded)" : it->second;
    if (got != h.get<std::string>())
      return "step " + step + ": state_hash differs: golden " + h.get<std::string>() + ", now " + got;
  }
  if (g.at("final_state_hash").get<std::string>() != r.final_state_hash)
    return "final_state_hash differs: golden " + g.at("final_state_hash").get<std::string>() + ", now " +
           r.final_state_hash;
  return "";
}

}  // namespace ls
