// A run that took its checkpoint lease itself (no supervisor) and is then
// stopped by SIGINT, SIGTERM or SIGHUP: the lease is released at once, so
// the next job on the prefix need not wait out its expiry, and the process
// ends as the signal would have ended it (130, 143 in a shell), saying so.
#pragma once

#include <atomic>
#include <string>
#include <thread>

#include "ckpt/lease.h"
#include "common/stop_signals.h"

namespace ls {

class LeaseStopGuard {
 public:
  // url: the checkpoint prefix, for the message. Watches from a thread of
  // its own until it is destroyed.
  LeaseStopGuard(CheckpointLease& lease, std::string url);
  ~LeaseStopGuard();
  LeaseStopGuard(const LeaseStopGuard&) = delete;
  LeaseStopGuard& operator=(const LeaseStopGuard&) = delete;
  // The step being trained, for the message.
  void at_step(int step) { step_ = step; }

 private:
  const StopSignals signals_{true};  // interrupted calls of the training threads resume
  CheckpointLease& lease_;
  const std::string url_;
  std::atomic<int> step_{0};
  std::atomic<bool> done_{false};
  std::thread watcher_;
};

}  // namespace ls
