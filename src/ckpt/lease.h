// One live job per checkpoint prefix: the lease.
//
// A job that writes checkpoints holds its prefix through a lease: objects
// "lease/GGGGGGGGGGGG.json" under the prefix, one per generation G. The
// newest generation is the lease, and G is its holder's fencing token,
// recorded in every manifest the holder commits.
//  - Taking: create generation G+1 with put_if_absent (If-None-Match: * on
//    S3, link(2) on files), so two jobs can never both create it. Allowed
//    when the prefix has no lease, when generation G was released, when it
//    expired more than kLeaseClockGraceSeconds ago, when G is the same
//    job's (a supervised job restarting its children), or when G's holder
//    ran on this host (same boot, same pid namespace) and its pid is gone.
//  - Renewing: the holder rewrites its own generation with a later expiry,
//    every ttl/3, on a thread of its own.
//  - Checking: before every commit and every deletion the holder reads the
//    newest generation back; unless it is its own, unreleased and unexpired
//    by the holder's clock, the lease is lost and the job stops without
//    committing (LeaseLost, exit kExitLeaseLost).
//  - Releasing: a job that ends marks its generation released, so the next
//    job need not wait out the expiry.
// Expiry is wall-clock time, as hosts share a prefix but not a clock: a
// taker waits a grace past the expiry it reads, so a holder whose clock
// lags a little has stopped committing before anyone takes over.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "store/store.h"

namespace ls {

// Exit code of a job that lost its lease to another job.
constexpr int kExitLeaseLost = 88;
// Seconds past a lease's expiry before another job may take it.
constexpr double kLeaseClockGraceSeconds = 2.0;

// The lease is held by another job now: stop, commit nothing.
struct LeaseLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One generation's object.
struct LeaseRecord {
  int64_t generation = 0;
  std::string job;          // the holder's job id
  std::string host;         // where it ran, for messages
  int pid = 0;              // the process that took it (the supervisor, or the run)
  // This machine and pid namespace (boot id and namespace inode): a holder
  // whose host_id is this process's can be looked up by pid, and a dead one
  // frees the lease at once. Empty in leases older than the field.
  std::string host_id;
  double expires_unix = 0;  // wall clock, seconds
  double ttl_seconds = 0;
  bool released = false;
  nlohmann::json to_json() const;
  // Throws UserError naming `origin` on anything malformed.
  static LeaseRecord from_json(const std::vector<uint8_t>& bytes, const std::string& origin);
  // "job J (pid P on H)", for messages.
  std::string holder() const;
};

// This process's LeaseRecord::host_id.
std::string this_host_id();
// A job id unique to this process and moment: "HOST-PID-XXXXXXXX".
std::string new_job_id();
// The key of generation g: "lease/000000000012.json".
std::string lease_key(int64_t generation);
// The newest generation under the store; generation 0 when there is none.
LeaseRecord read_current_lease(ObjectStore& store);

class CheckpointLease {
 public:
  // Takes the prefix for `job` (a new generation), or throws UserError
  // naming the holder when another job's lease is live. wait: a live lease
  // of another job is waited out instead (`say` tells the user once), and
  // refused only if its holder renews it meanwhile, which proves it alive.
  // renew: keep it alive from a thread of this process until release().
  static std::unique_ptr<CheckpointLease> acquire(std::shared_ptr<ObjectStore> store, const std::string& job,
                                                  double ttl_seconds, bool wait,
                                                  const std::function<void(const std::string&)>& say);
  // Writes under a lease another process of the same job holds and renews
  // (a supervised child under its supervisor's): checks only.
  static std::unique_ptr<CheckpointLease> attach(std::shared_ptr<ObjectStore> store, const std::string& job,
                                                 int64_t generation);
  ~CheckpointLease();  // release()s a lease this process took

  // Throws LeaseLost unless the newest generation is still this one,
  // unreleased, and unexpired. One list and one read of the store.
  void check();
  // Set by the renewal thread once it saw another generation: the job can
  // stop at its next step instead of at its next commit.
  bool known_lost() const { return lost_.load(); }
  // Stops renewing and marks the generation released, if it is still this
  // job's (best effort: a failure leaves it to expire). Only a lease this
  // process took; once, whichever thread calls it first.
  void release();
  // Whether this process took the lease (and so renews and releases it).
  bool owned() const { return owner_.load(); }
  int64_t generation() const { return gen_; }
  const std::string& job() const { return job_; }
  double ttl_seconds() const { return ttl_; }

 private:
  CheckpointLease(std::shared_ptr<ObjectStore> store, LeaseRecord mine);
  void start_renewing();
  void renew_once();  // rewrites the expiry; sets lost_ if another generation is newer

  std::shared_ptr<ObjectStore> store_;
  LeaseRecord mine_;
  std::string job_;
  int64_t gen_ = 0;
  double ttl_ = 0;
  // Took it (renews and releases it), as opposed to attached. Atomic: a stop
  // signal's thread may release it while the run finishes (runner/stop_guard.h).
  std::atomic<bool> owner_{false};
  std::atomic<bool> lost_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread renewer_;
};

}  // namespace ls
