// Target "scenario": the scenario loader with `--set` overrides, called as
// `lockstep run FILE --set K=V ...` calls it (load_scenario on a path), then
// what every run computes from it (fingerprint, the resolved document).
#include <string>
#include <vector>

#include "common/error.h"
#include "harness.h"
#include "runner/scenario.h"

namespace ls::fuzz {

Outcome scenario_one(const uint8_t* data, size_t n) {
  static MemFile file;
  const std::vector<std::string> parts = split_nul(data, n);
  file.set(parts[0]);
  const std::vector<std::string> sets(parts.begin() + 1, parts.end());
  Scenario s;
  try {
    s = load_scenario(file.path(), sets);
  } catch (const UserError& e) {
    return rejected(e);
  }
  const std::string fp = scenario_fingerprint(s);
  // The run summary (--json) and the trace header print it.
  (void)s.resolved.dump();
  // scenario.h: `resolved` is every key with its effective value, so it
  // loads back to the same scenario (bisect and golden reruns rely on it).
  Scenario back;
  try {
    back = scenario_from_json(s.resolved, file.path(), {});
  } catch (const UserError& e) {
    throw Violation(std::string("the resolved scenario does not load back: ") + e.what());
  }
  if (back.resolved != s.resolved) throw Violation("the resolved scenario loads back different: " + back.resolved.dump());
  if (scenario_fingerprint(back) != fp) throw Violation("the resolved scenario loads back with another fingerprint");
  return Outcome::kAccepted;
}

}  // namespace ls::fuzz

LOCKSTEP_FUZZ_ENTRY(ls::fuzz::scenario_one)
