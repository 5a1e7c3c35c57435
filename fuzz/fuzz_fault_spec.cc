// Target "fault_spec": the `--fault KIND@STEP[:k=v,...]` parser, as
// `lockstep run --fault SPEC` calls it, and the two round trips that
// fault_spec.h promises.
#include <string>

#include "common/error.h"
#include "faults/fault_spec.h"
#include "harness.h"

namespace ls::fuzz {

Outcome fault_spec_one(const uint8_t* data, size_t n) {
  // An argv string ends at its first NUL.
  const std::string text = split_nul(data, n)[0];
  FaultSpec f;
  try {
    f = parse_fault(text);
  } catch (const UserError& e) {
    return rejected(e);
  }
  const std::string canon = f.text();
  FaultSpec g;
  try {
    g = parse_fault(canon);
  } catch (const UserError& e) {
    throw Violation("parse_fault(f.text()) rejects '" + canon + "': " + e.what());
  }
  if (g != f) throw Violation("parse_fault(f.text()) != f for '" + canon + "'");
  // The scenario's `faults` list and the supervisor's state file hold this form.
  const nlohmann::json j = fault_to_json(f);
  (void)j.dump();
  FaultSpec h;
  try {
    h = fault_from_json(j, "faults[0]");
  } catch (const UserError& e) {
    throw Violation("fault_from_json(fault_to_json(f)) rejects " + j.dump() + ": " + e.what());
  }
  if (h != f) throw Violation("fault_from_json(fault_to_json(f)) != f for " + j.dump());
  return Outcome::kAccepted;
}

}  // namespace ls::fuzz

LOCKSTEP_FUZZ_ENTRY(ls::fuzz::fault_spec_one)
