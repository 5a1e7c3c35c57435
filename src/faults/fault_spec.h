// A fault to inject into a run: what breaks (kind), when (a training step and
// a phase within it) and how (per-kind options). Written on the command line
// as `--fault KIND@STEP[:key=value,...]` or in a scenario's `faults` list as
// a JSON object; both forms parse to the same FaultSpec and both are
// validated here. Checks that need the scenario (step <= train.steps, rank <
// mesh.dp, ...) live in the scenario's `faults` row. docs/FAULTS.md has the
// meaning of every kind and phase.
//
// Every error throws ls::UserError naming the spec (or JSON location) and
// the field.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace ls {

enum class FaultKind {
  kRankCrash,       // one rank dies
  kProcessKill,     // the whole job is killed (SIGKILL, no cleanup)
  kUploadCrash,     // the job dies mid-checkpoint-upload or before the manifest lands
  kStoreTransient,  // some store calls fail (retryable), optionally slowly
  kStoreDown,       // every store call fails
  kBitrot,          // a committed checkpoint object is corrupted in the store
  kShrink,          // the job restarts on fewer data-parallel ranks
  kGrow,            // the job restarts on more data-parallel ranks
  kStraggler,       // one rank runs slow
};

enum class FaultPhase {
  kStepStart,
  kForward,
  kBackward,
  kOptimizer,
  kCkptStaging,
  kCkptUpload,
  kManifestWrite,
  kAny,
};

struct FaultSpec {
  FaultKind kind = FaultKind::kProcessKill;
  int step = 0;              // 1-based training step at which it triggers (>= 1)
  FaultPhase phase = FaultPhase::kStepStart;
  int rank = 0;              // the rank it hits (rank_crash, straggler)
  int after_objects = -1;    // kCkptUpload: crash after this many objects uploaded (-1: unset)
  int64_t after_bytes = -1;  // kCkptUpload: or after this many bytes (-1: unset)
  int calls = 0;             // store_transient: how many store calls fail (>= 1)
  double latency = 0;        // store_transient: seconds added to each failing call
  int dp = 0;                // shrink/grow: the new mesh.dp to restart on
  double slow = 0;           // straggler: seconds of delay per step on that rank

  // Canonical "KIND@STEP[:k=v,...]": options in a fixed order, only those
  // away from their defaults. parse_fault(f.text()) == f.
  std::string text() const;
};

bool operator==(const FaultSpec& a, const FaultSpec& b);
inline bool operator!=(const FaultSpec& a, const FaultSpec& b) { return !(a == b); }

// "process_kill@12:phase=ckpt_upload,after_objects=1", "store_transient@3:calls=4,latency=0.01",
// "shrink@10:dp=2", "bitrot@8", "straggler@2:rank=1,slow=0.05". Throws
// UserError "--fault SPEC: ..." naming the bad part.
FaultSpec parse_fault(const std::string& text);

// {"kind": "process_kill", "step": 12, "phase": "ckpt_upload", "after_objects": 1}.
// `where` names the object in errors, e.g. "faults[2]" gives
// "faults[2].phase: unknown phase 'upload' (did you mean 'ckpt_upload'?)".
FaultSpec fault_from_json(const nlohmann::json& j, const std::string& where);

// Every option that applies to the kind (phase and rank included at their
// defaults; after_objects/after_bytes only when set). fault_from_json reads
// it back equal.
nlohmann::json fault_to_json(const FaultSpec& f);

const char* fault_kind_name(FaultKind k);    // "rank_crash", ...
const char* fault_phase_name(FaultPhase p);  // "step_start", ...

// True for the phases inside a checkpoint save (ckpt_staging, ckpt_upload,
// manifest_write): such a fault fires while the checkpoint of its step is saved.
bool is_checkpoint_phase(FaultPhase p);

}  // namespace ls
