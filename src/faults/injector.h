// The child side of fault injection: fires each planned fault once, at its
// trigger (step and phase), for real -- the process exits or is SIGKILLed,
// the store starts failing, a committed object rots -- and first records
// the firing in the supervisor's state file, so a restarted child skips it.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "faults/fault_spec.h"
#include "store/faulty_store.h"

namespace ls {

// Exit codes a child uses to say why it stopped.
constexpr int kExitRankCrash = 86;   // a rank died: the job lost every rank's memory
constexpr int kExitMeshChange = 87;  // shrink/grow: restart on another mesh

class FaultInjector {
 public:
  // `fired`: indices of faults that already fired in earlier attempts.
  FaultInjector(std::vector<FaultSpec> faults, std::set<int> fired, std::string state_path);

  // Trigger points. step is 1-based; phases as in FaultPhase names.
  void at(int step, FaultPhase phase, int rank = 0);
  // Wraps the checkpoint store so store faults and upload crashes can fire.
  std::shared_ptr<ObjectStore> wrap(std::shared_ptr<ObjectStore> store);
  // After the checkpoint of `step` committed (bitrot@step fires here).
  void after_commit(int64_t step);
  // A restarted attempt's start: a bitrot whose checkpoint an earlier attempt
  // committed but was killed before rotting it (the commit and the hook are
  // two moments) rots it now, before anything restores from it.
  void rot_committed(ObjectStore& store);
  void set_step(int step) { step_ = step; }
  // Under MPI: this process holds rank `rank` alone. A fault fires
  // only in the process of its home rank, so each fires once per job: its
  // `rank` for rank_crash and straggler; for a ckpt_upload fault with
  // after_objects=K, rank K (each rank writes one object: the job dies with
  // K objects possibly written, as in one process), firing before that
  // rank's own object; rank 0 for the rest (process_kill, manifest and store
  // faults, shrink, grow). -1 (default): every rank is in this process.
  void set_process_rank(int rank) { process_rank_ = rank; }

  const std::vector<FaultSpec>& faults() const { return faults_; }

 private:
  // Records (with `step`, or the current step when -1), then acts.
  void fire(int index, const std::string& detail, int step = -1);
  void rot(int index, ObjectStore& store);  // bitrot fault `index`: under mu_
  // Not fired yet, and its home rank is in this process.
  bool pending(int index) const;

  std::vector<FaultSpec> faults_;
  std::set<int> fired_;
  std::string state_path_;
  std::shared_ptr<FaultyStore> store_;
  std::shared_ptr<ObjectStore> inner_;
  std::mutex mu_;
  int step_ = 0;
  int process_rank_ = -1;
  std::map<std::string, int> put_objects_;      // objects started, per checkpoint directory
  std::map<std::string, uint64_t> put_bytes_;   // store byte total when its first object started
};

// Reads a supervisor state file: the fired fault indices and, for
// shrink/grow, the new data-parallel size (0 if none).
struct FiredFaults {
  std::set<int> indices;
  int new_dp = 0;
  std::vector<std::string> lines;
};
FiredFaults read_fault_state(const std::string& path);

// The committed checkpoints a fired bitrot (state file at `state_path`) left
// corrupt in `store` at the end of a job: each corrupted object whose
// manifest is still there is read and checked against it (a replay's re-save
// of the step heals it; keep_last may have removed it). One entry per object
// still bad: {"step", "key", "why"}.
nlohmann::json corrupt_checkpoints_left(const std::string& state_path, ObjectStore& store);

}  // namespace ls
