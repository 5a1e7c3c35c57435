// The bookkeeping every started collective shares (Communicator::start_*):
// its time in flight and its exposed wait, added to its communicator's
// CommStats. For the Communicator implementations only.
#pragma once

#include <chrono>

#include "cluster/communicator.h"

namespace ls {

class TimedPending : public PendingCollective {
 public:
  TimedPending(CommStats* stats, const char* kind)
      : stats_(stats), kind_(kind), t0_(std::chrono::steady_clock::now()) {
    ++stats->started;
  }
  bool test() final {
    if (!done_ && poll()) finish();
    return done_;
  }
  void wait() final {
    if (done_) return;
    {
      const CommStats::Timer exposed(stats_, kind_);
      block();
    }
    finish();
  }

 protected:
  using Clock = std::chrono::steady_clock;
  // True once the collective completed (without blocking).
  virtual bool poll() = 0;
  // Until it completed; throws what the collective threw.
  virtual void block() = 0;
  // When it completed, where the implementation knows better than "now".
  virtual Clock::time_point completed_at() { return Clock::now(); }
  bool done() const { return done_; }

 private:
  void finish() {
    done_ = true;
    stats_->add_in_flight(t0_, completed_at());
  }
  CommStats* stats_;
  const char* kind_;
  Clock::time_point t0_;
  bool done_ = false;
};

}  // namespace ls
