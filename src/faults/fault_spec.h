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
#include <vector>

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

// ------------------------------------------------------------ kinds ---
// Every property of a kind is a column of one table (fault_kind_rows()):
// the parser, the scenario's checks, the injector and the sweep ask it
// instead of testing kinds by name. docs/FAULTS.md's "Kinds" table is this
// one, rendered (the `faults` suite holds the page to it).

// The options after KIND@STEP, one bit each, in canonical (text()) order.
enum FaultOption : unsigned {
  kOptPhase = 1u << 0,
  kOptRank = 1u << 1,
  kOptAfterObjects = 1u << 2,
  kOptAfterBytes = 1u << 3,
  kOptCalls = 1u << 4,
  kOptLatency = 1u << 5,
  kOptDp = 1u << 6,
  kOptSlow = 1u << 7,
};

// What a kind needs from the scenario before it can fire (checked by the
// scenario's `faults` row). Every fault also needs the supervisor, which
// any fault turns on.
enum FaultNeeds : unsigned {
  kNeedsCheckpoints = 1u << 0,  // ckpt.url and ckpt.every >= 1 (whatever its phase)
  kNeedsCommitted = 1u << 1,    // the checkpoint of its step, and an older one: step a multiple of ckpt.every, > it
  kNeedsRank = 1u << 2,         // its `rank` is a rank of the world: the one it hits, its home process under MPI
  kNeedsMeshDp = 1u << 3,       // its `dp` is a valid mesh.dp: the job restarts on it
};

// Where the injector fires it (FaultInjector), one bit per trigger point.
enum FaultFires : unsigned {
  kFiresAtPhase = 1u << 0,    // FaultInjector::at(): its step and phase (but ckpt_upload, manifest_write)
  kFiresInUpload = 1u << 1,   // the checkpoint store's put hook: at phase ckpt_upload or manifest_write
  kFiresOnCommit = 1u << 2,   // after_commit(): when its step's checkpoint commits
  kFiresEveryStep = 1u << 3,  // at the start of every step from its step on, on its rank
};

// What it does once fired.
enum class FaultEffect {
  kRankExit,    // exit kExitRankCrash: a rank died
  kKill,        // SIGKILL: the whole job, no cleanup
  kStoreFails,  // the next `calls` store calls fail
  kStoreDown,   // every store call fails
  kRot,         // a committed checkpoint object is corrupted
  kMeshExit,    // exit kExitMeshChange: restart on mesh.dp = `dp`
  kSlow,        // its rank sleeps `slow` seconds a step
};

// Whether `lockstep faults sweep` may draw it.
enum class SweepDraw {
  kNever,
  kKill,        // a trial's kill (at a random step and phase, or in checkpoint I/O)
  kStoreFault,  // added to some trials by --store-faults
};

struct FaultKindRow {
  FaultKind kind;
  const char* name;
  const char* what;   // what happens, in words (the docs' table)
  unsigned options;   // FaultOption bits it takes
  unsigned required;  // those of them it cannot do without
  unsigned needs;     // FaultNeeds bits
  unsigned fires;     // FaultFires bits
  FaultEffect effect;
  SweepDraw sweep;
};

// One row per kind, in FaultKind order.
const std::vector<FaultKindRow>& fault_kind_rows();
const FaultKindRow& fault_kind_row(FaultKind k);
inline const FaultKindRow& row_of(const FaultSpec& f) { return fault_kind_row(f.kind); }
// An option's name ("after_objects"), for one FaultOption bit.
const char* fault_option_name(unsigned bit);

const char* fault_kind_name(FaultKind k);    // "rank_crash", ...
const char* fault_phase_name(FaultPhase p);  // "step_start", ...

// True for the phases inside a checkpoint save (ckpt_staging, ckpt_upload,
// manifest_write): such a fault fires while the checkpoint of its step is saved.
bool is_checkpoint_phase(FaultPhase p);

}  // namespace ls
