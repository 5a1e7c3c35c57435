// SIGINT, SIGTERM and SIGHUP, caught so that a long command ends in order:
// it passes the signal on to what it started, releases what it holds, says
// so in one line, and dies of the same signal (exit status 128 + signal in
// a shell), as an interrupted command should.
#pragma once

#include <signal.h>

#include <stdexcept>
#include <string>

namespace ls {

// While one lives, the three stop signals are recorded (stop_signal())
// instead of killing the process; the handlers before it come back when it
// goes. A signal the caller ignores (nohup, a shell's background job) stays
// ignored. They nest within one thread (a faults sweep around each trial's
// supervisor): an inner one keeps a signal recorded before it, so none is
// lost between the two. Not shared across threads: one owner at a time.
class StopSignals {
 public:
  // restart_calls: system calls a signal interrupts resume (SA_RESTART), for
  // a process whose other threads must not see EINTR while it stops;
  // otherwise a blocking wait (waitpid) returns to look at stop_signal().
  explicit StopSignals(bool restart_calls = false);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_[3];
};

// The stop signal received since the last StopSignals was installed; 0 if none.
int stop_signal();
// "SIGINT", "SIGTERM", "SIGHUP", or "signal N".
std::string stop_signal_name(int sig);
// Restores the signal's default action and raises it: the process ends as
// killed by `sig`. Flushes stdio first; runs no destructors.
[[noreturn]] void die_of_signal(int sig);

// A command stopped by a stop signal while it waited on something it
// started: the CLI prints what() in one line and dies of signal().
class Interrupted : public std::runtime_error {
 public:
  Interrupted(int sig, const std::string& what) : std::runtime_error(what), sig_(sig) {}
  int signal() const { return sig_; }

 private:
  int sig_;
};

}  // namespace ls
