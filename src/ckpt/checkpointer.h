// Saving and restoring training state through an object store.
//
// Save (checkpointer.cc): the trainer (a Checkpointable, checkpointable.h)
// stages its state into DRAM (the only part that blocks training); a
// background job encodes each rank's pieces as one safetensors object,
// uploads them, then commits by writing the manifest last, and only then
// deletes checkpoints beyond keep_last. An upload error surfaces at the next
// save() or at finish(), never lost in a thread, and never leaves a manifest
// pointing at missing objects.
//
// Restore (restore.cc): read the manifest(s), then every object exactly
// once, by a reader rank chosen round-robin, and broadcast its bytes to the
// ranks; each rank keeps the parts of the global tensors it holds on its own
// mesh, whatever mesh saved them (resharding).
//
// Across processes (mpirun, one rank each): every process writes its own
// rank's object on its uploader thread; the commit is a collective run on
// the main thread (MPI is initialised FUNNELED): poll() at each step end
// gathers every rank's status of the oldest pending checkpoint, and once all
// have written, rank 0 receives the objects' descriptions and staged pieces,
// hashes the state and writes the manifest. A rank whose upload failed fails
// that checkpoint on every rank, and no manifest is written. Restore reads
// each object once, on its reader process, and broadcasts it over MPI.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/config.h"
#include "ckpt/manifest.h"
#include "ckpt/checkpointable.h"
#include "store/store.h"

namespace ls {

struct SaveRecord {
  int64_t step = 0;
  double stall_seconds = 0;   // training blocked: wait_seconds + stage_seconds
  double wait_seconds = 0;    // waiting for a free upload slot (back-pressure)
  double stage_seconds = 0;   // copying the state to DRAM staging
  double upload_seconds = 0;  // background: encode, upload objects, commit the manifest
  double put_seconds = 0;     // of which writing the objects to the store (slowest rank)
  uint64_t bytes = 0;         // object bytes written
  bool committed = false;
};

class Communicator;

class CheckpointWriter {
 public:
  // mpi: this process is one rank of an MPI job (every rank constructs a
  // writer and calls save/poll/finish at the same steps); nullptr: the
  // trainer's ranks are all in this process.
  CheckpointWriter(const CheckpointConfig& cfg, std::shared_ptr<ObjectStore> store, nlohmann::json scenario,
                   std::string fingerprint, nlohmann::json mesh, Communicator* mpi = nullptr);
  ~CheckpointWriter();  // waits for uploads; errors then are reported on stderr

  // Stages the state and starts the upload (or uploads now when not
  // async). Rethrows the error of an earlier failed upload.
  void save(int64_t step, Checkpointable& state);
  // Waits for every upload; rethrows the first error.
  void finish();
  // Under MPI: commits every pending checkpoint whose objects all ranks have
  // written (one small all-gather when any is pending). A no-op otherwise.
  void poll();
  std::vector<SaveRecord> records();
  // Store trouble the saves met (ckpt.retry_seconds, ckpt.on_failure):
  // saves that failed past the retry budget and were let go (continue),
  // retries made in all, and the longest stretch of transient errors a call
  // rode out to success.
  struct StoreTrouble {
    int failed_saves = 0;
    uint64_t retries = 0;
    double longest_outage_seconds = 0;
  };
  StoreTrouble store_trouble();
  // Called (on the uploader thread) after a checkpoint's manifest committed.
  void set_commit_hook(std::function<void(int64_t step)> hook) { commit_hook_ = std::move(hook); }
  // Called right before a manifest is written and before keep_last deletes
  // anything; it throws (LeaseLost) when this job may no longer write the
  // prefix, and nothing is committed or deleted.
  void set_commit_guard(std::function<void()> guard) { commit_guard_ = std::move(guard); }
  // The fencing token every manifest records: the job's lease generation.
  void set_lease_token(std::string job, int64_t generation) {
    lease_job_ = std::move(job);
    lease_generation_ = generation;
  }
  // Called once per save when it settles: committed (error empty; bytes are
  // the object bytes written) or failed (error says why; bytes are those of
  // the objects it encoded). On the uploader thread, or the training thread
  // under MPI and for synchronous saves. For the progress line.
  void set_settled_hook(std::function<void(const SaveRecord& rec, const std::string& error)> hook) {
    settled_hook_ = std::move(hook);
  }

 private:
  struct Job;
  void upload(Job& job);
  void write_objects(Job& job);  // every staged rank's object, in parallel
  void commit(Job& job);         // manifest last; then keep_last
  // MPI: commits (or fails everywhere) the oldest pending checkpoint once every
  // rank has written its object; wait: block for this rank's upload first.
  // Returns whether it left the queue. Collective.
  bool settle_oldest(bool wait);
  void collect_garbage();
  // f under the retry budget, its retries and outage counted.
  template <class F> auto retry(F f) -> decltype(f());
  // A save failure ckpt.on_failure=continue lets go: a transient store error
  // past the retry budget (a permanent one, bad input or a lost lease stop).
  bool let_go(std::exception_ptr error) const;
  void note_failed_save(int64_t step, std::exception_ptr error);

  CheckpointConfig cfg_;
  std::shared_ptr<ObjectStore> store_;
  nlohmann::json scenario_, mesh_;
  std::string fingerprint_;
  std::mutex mu_;
  std::condition_variable cv_;
  int inflight_ = 0;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
  std::vector<SaveRecord> records_;
  std::vector<std::vector<std::vector<StatePiece>>> spare_;  // staging buffers of finished uploads, for reuse
  std::function<void(int64_t)> commit_hook_;
  std::function<void()> commit_guard_;
  std::string lease_job_;
  int64_t lease_generation_ = 0;
  StoreTrouble trouble_;  // under mu_
  std::function<void(const SaveRecord&, const std::string&)> settled_hook_;
  void settled(const Job& job, std::exception_ptr error);  // calls settled_hook_
  Communicator* mpi_ = nullptr;  // chooses the data flow of save (see save())
  std::unique_ptr<Communicator> solo_;  // processes_ when this process is alone
  Communicator* processes_ = nullptr;   // the processes sharing this checkpoint: mpi_, or solo_
  std::deque<std::shared_ptr<Job>> pending_;  // MPI: saved, not yet committed (oldest first)
};

struct RestoreReport {
  int64_t step = 0;
  std::string url, mode;
  uint64_t store_bytes_read = 0;  // bytes fetched from the store, all ranks
  uint64_t checkpoint_bytes = 0;  // bytes of the checkpoint's objects
  double seconds = 0;
  std::string saved_mesh;
};

// Every rank of comm learns whether `root` failed: root passes its error (or
// nullptr), the others nullptr. On a failure every rank throws: root its own
// exception, the others one of the same kind (UserError, CorruptCheckpoint,
// StoreError, LeaseLost, InternalError, else runtime_error) with root's
// message after `context` and "rank N: ". Collective.
void share_error(Communicator& comm, int root, std::exception_ptr error, const std::string& context);

// "URL@STEP" -> (URL, STEP); a URL without "@" -> (URL, -1): the latest.
// "URL@abc" (no '/' after the '@', not digits) is refused, UserError naming
// the step, unless a local folder of that whole name exists.
std::pair<std::string, int64_t> split_checkpoint_url(const std::string& text);

// Loads the manifest's state into every rank of `state`. mpi: `state`
// holds this process's rank only; objects travel between processes
// and store_bytes_read counts every process's reads. A failure is agreed:
// every process throws, and no rank loads anything.
RestoreReport restore_state(Checkpointable& state, ObjectStore& store, const Manifest& m, const std::string& mode,
                            Communicator* mpi = nullptr, const std::optional<RetryPolicy>& retry = std::nullopt);

}  // namespace ls
