// A lockstep command started in the background, as from a user's shell,
// for the tests that signal, freeze or race whole jobs: its pid, its
// stdout and stderr files, and a TMPDIR of its own (so a test can see what
// scratch directories the job leaves behind).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cli_run.h"

extern char** environ;

namespace lstest {

struct BackgroundRun {
  pid_t pid = -1;
  std::filesystem::path out, err, tmpdir;

  BackgroundRun() = default;
  BackgroundRun(const BackgroundRun&) = delete;
  BackgroundRun& operator=(const BackgroundRun&) = delete;
  BackgroundRun(BackgroundRun&& o) noexcept : pid(o.pid), out(o.out), err(o.err), tmpdir(o.tmpdir) { o.pid = -1; }

  // Starts LOCKSTEP_BIN with `args` (one word each, no shell) and SIGINT at
  // its default action, as a foreground command of a terminal has it.
  static BackgroundRun start(const std::vector<std::string>& args, const std::string& name) {
    BackgroundRun r;
    const std::filesystem::path base = cli_temp_dir() / ("bg-" + name);
    std::filesystem::remove_all(base);
    std::filesystem::create_directories(base / "tmp");
    r.out = base / "stdout";
    r.err = base / "stderr";
    r.tmpdir = base / "tmp";
    std::vector<std::string> env = {"TMPDIR=" + r.tmpdir.string()};
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "TMPDIR=", 7) != 0) env.emplace_back(*e);
    std::vector<std::string> words = {LOCKSTEP_BIN};
    words.insert(words.end(), args.begin(), args.end());
    std::vector<char*> argv, envp;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, r.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, r.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t dflt;
    sigemptyset(&dflt);
    sigaddset(&dflt, SIGINT);
    sigaddset(&dflt, SIGTERM);
    posix_spawnattr_setsigdefault(&attr, &dflt);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
    const int rc = posix_spawn(&r.pid, argv[0], &fa, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) throw std::runtime_error(std::string("cannot start lockstep: ") + std::strerror(rc));
    return r;
  }

  // Its exit status as a shell reports it (128 + N for signal N), or -1 if
  // it is still running after `seconds`.
  int wait(double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    for (;;) {
      int st = 0;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      if (std::chrono::steady_clock::now() > until) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  std::string stdout_text() const { return slurp(out); }
  std::string stderr_text() const { return slurp(err); }

  ~BackgroundRun() {  // a failed test leaves nothing running
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

// Polls `done` every 5 ms for up to `seconds`; returns its last answer.
template <class F>
bool wait_until(F done, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace lstest
