#include "common/stop_signals.h"

#include <cstdio>
#include <cstdlib>

namespace ls {
namespace {

constexpr int kStopSignals[3] = {SIGINT, SIGTERM, SIGHUP};
volatile sig_atomic_t g_stop_signal = 0;
int g_depth = 0;  // StopSignals alive; only the outermost starts from no signal
extern "C" void record_stop_signal(int sig) { g_stop_signal = sig; }

}  // namespace

StopSignals::StopSignals(bool restart_calls) {
  if (g_depth++ == 0) g_stop_signal = 0;  // an inner one keeps what the outer one recorded
  for (int i = 0; i < 3; ++i) {
    struct sigaction sa {};
    sa.sa_handler = record_stop_signal;
    sa.sa_flags = restart_calls ? SA_RESTART : 0;
    sigemptyset(&sa.sa_mask);
    ::sigaction(kStopSignals[i], nullptr, &old_[i]);
    if (old_[i].sa_handler != SIG_IGN) ::sigaction(kStopSignals[i], &sa, nullptr);
  }
}

StopSignals::~StopSignals() {
  for (int i = 0; i < 3; ++i) ::sigaction(kStopSignals[i], &old_[i], nullptr);
  --g_depth;
}

int stop_signal() { return g_stop_signal; }

std::string stop_signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    default: return "signal " + std::to_string(sig);
  }
}

void die_of_signal(int sig) {
  std::fflush(nullptr);
  ::signal(sig, SIG_DFL);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
  std::_Exit(128 + sig);
}

}  // namespace ls
