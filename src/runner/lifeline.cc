#include "runner/lifeline.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

namespace ls {
namespace {

std::atomic<int> g_watched{0};     // the supervisor's pid, 0 when none is watched
std::atomic<int> g_pidfd{-1};      // its pidfd, -1 without one
std::atomic<bool> g_ending{false};  // one thread is already ending the process
std::string g_cleanup_dir;          // set before the watch starts, read-only after

bool process_exists(int pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

// A pidfd is readable once its process has ended (a zombie not yet reaped
// included, which kill(pid, 0) would still find).
bool pidfd_ended(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, timeout_ms) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR));
}

// Whichever thread finds the supervisor gone first (the watch thread, or one
// checking before a commit) prints, cleans up and _exits; a second one waits
// for that _exit. Neither returns, so no error path can exit the process
// halfway through the cleanup.
[[noreturn]] void supervisor_gone(int pid, const std::string& cleanup_dir) {
  if (g_ending.exchange(true))
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  std::fprintf(stderr,
               "lockstep: the supervisor (pid %d) is gone: this job stops now, committing nothing more "
               "(exit %d)\n",
               pid, kExitSupervisorLost);
  std::fflush(stderr);
  if (!cleanup_dir.empty()) {
    // The other threads run on until _exit: moved aside first, the
    // directory gets no new files from them (a step log line, say) while it
    // is removed. Several ranks may race for it: errors are expected.
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path gone = cleanup_dir + ".gone-" + std::to_string(::getpid());
    fs::rename(cleanup_dir, gone, ec);
    const fs::path& victim = ec ? fs::path(cleanup_dir) : gone;
    for (int i = 0; i < 50 && fs::exists(victim, ec); ++i) {
      fs::remove_all(victim, ec);
      if (fs::exists(victim, ec)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  ::_exit(kExitSupervisorLost);
}

}  // namespace

void watch_supervisor(int pid, const char* cleanup_dir) {
  g_cleanup_dir = cleanup_dir ? cleanup_dir : "";
  const std::string dir = g_cleanup_dir;
  // A pidfd turns readable when the process ends: no polling delay. It refers
  // to the process, so a recycled pid cannot fool it once it is open.
  int fd = -1;
#ifdef SYS_pidfd_open
  fd = (int)::syscall(SYS_pidfd_open, pid, 0);
#endif
  if (fd < 0) {
    // An older kernel: poll the pid, and where the supervisor is the parent,
    // have the kernel kill this process with it too (no message, no
    // cleanup, but no 100 ms of polling either). Checking getppid() after
    // prctl closes the race with a parent that died before it.
    if (::getppid() == pid) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != pid) supervisor_gone(pid, dir);
    }
    if (!process_exists(pid)) supervisor_gone(pid, dir);
  }
  g_pidfd = fd;
  g_watched = pid;
  // A main thread that returns or exits while the watch thread cleans up
  // would end the process halfway through: exit() waits for its _exit.
  std::atexit([] {
    if (g_ending.load())
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  });
  std::thread([pid, fd, dir] {
    for (;;) {
      if (fd >= 0) {
        if (pidfd_ended(fd, 1000)) supervisor_gone(pid, dir);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (!process_exists(pid)) supervisor_gone(pid, dir);
      }
    }
  }).detach();
}

void require_supervisor() {
  const int pid = g_watched.load(), fd = g_pidfd.load();
  if (pid == 0) return;
  if (fd >= 0 ? pidfd_ended(fd, 0) : !process_exists(pid)) supervisor_gone(pid, g_cleanup_dir);
}

void write_heartbeat(const std::string& path, int step) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  if (FILE* hb = std::fopen(tmp.c_str(), "w")) {
    std::fprintf(hb, "%d\n", step);
    if (std::fclose(hb) == 0) std::rename(tmp.c_str(), path.c_str());
  }
}

void append_step_log(const std::string& path, const std::string& line) {
  if (path.empty()) return;
  if (FILE* f = std::fopen(path.c_str(), "a")) {
    std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
  }
}

}  // namespace ls
