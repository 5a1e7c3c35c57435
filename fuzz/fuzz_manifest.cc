// Target "manifest": a checkpoint manifest object as it sits in a store,
// read by read_manifest (what `run --resume` and `ckpt ls|inspect|verify`
// call) and by `ckpt gc` (find_orphans), then printed as `ckpt inspect --json`
// prints it.
#include <string>

#include "ckpt/checkpointer.h"
#include "ckpt/gc.h"
#include "ckpt/manifest.h"
#include "common/error.h"
#include "harness.h"

namespace ls::fuzz {

Outcome manifest_one(const uint8_t* data, size_t n) {
  MemStore store;
  store.objects[manifest_key(4)].assign(data, data + n);
  Outcome out = Outcome::kAccepted;
  try {
    const Manifest m = read_manifest(store, -1);
    const nlohmann::json j = manifest_to_json(m);
    (void)j.dump(2);
    (void)m.mesh.dump();
    // manifest.h: manifest_from_json reads what manifest_to_json writes.
    Manifest back;
    try {
      back = manifest_from_json(j, "round trip");
      validate_manifest(back, "round trip");
    } catch (const UserError& e) {
      throw Violation(std::string("an accepted manifest does not read back: ") + e.what());
    }
    if (manifest_to_json(back) != j) throw Violation("an accepted manifest reads back different");
  } catch (const UserError& e) {
    out = rejected(e);
  }
  // gc reads the same object on its own path; an unreadable manifest must
  // leave its step alone, not fail the whole gc.
  const GcReport r = find_orphans(store);
  if (r.committed_steps.size() != 1 || r.committed_steps[0] != 4)
    throw Violation("gc does not see the one committed step");
  return out;
}

}  // namespace ls::fuzz

LOCKSTEP_FUZZ_ENTRY(ls::fuzz::manifest_one)
