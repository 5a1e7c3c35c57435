#include "runner/stop_guard.h"

#include <chrono>
#include <cstdio>

namespace ls {

LeaseStopGuard::LeaseStopGuard(CheckpointLease& lease, std::string url) : lease_(lease), url_(std::move(url)) {
  // Polled, not waited for: a signal handler may only set a flag, and the
  // release is store I/O. 20 ms is nothing next to a user's Ctrl-C.
  watcher_ = std::thread([this] {
    while (!done_.load()) {
      if (const int sig = stop_signal()) {
        lease_.release();
        std::fprintf(stderr,
                     "lockstep: %s: stopped at step %d; released the checkpoint lease on %s, whose committed "
                     "checkpoints are intact (continue with --resume %s)\n",
                     stop_signal_name(sig).c_str(), step_.load(), url_.c_str(), url_.c_str());
        die_of_signal(sig);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
}

LeaseStopGuard::~LeaseStopGuard() {
  done_ = true;
  watcher_.join();
}

}  // namespace ls
