// The check every launcher's signal test runs: a supervised job, stopped
// through its supervisor by SIGINT, SIGTERM or SIGKILL once it has
// committed a checkpoint, leaves no process, no scratch directory and no
// commit after the signal behind.
#pragma once

#include <doctest/doctest.h>
#include <signal.h>

#include <filesystem>
#include <string>
#include <vector>

#include "background_run.h"
#include "ckpt/checkpointer.h"
#include "ckpt/lease.h"
#include "runner/supervisor.h"
#include "store/store.h"

namespace lstest {

// Processes whose command line names `dir` (the job's ckpt.url): the
// supervisor, its child or mpirun and the ranks.
inline std::vector<int> live_processes_of(const std::filesystem::path& dir) {
  return ls::live_processes_matching(dir.string());
}

inline std::vector<int64_t> commits_in(const std::filesystem::path& dir) {
  std::unique_ptr<ls::ObjectStore> store = ls::open_store(dir.string());
  return ls::committed_steps(*store);
}

// `job_args`: the supervised `lockstep run ...` words (ckpt.url = dir, a run
// long enough that it is still training when the signal lands).
inline void stop_supervisor_by(int sig, const std::vector<std::string>& job_args, const std::filesystem::path& dir,
                               const std::string& name) {
  CAPTURE(sig);
  BackgroundRun job = BackgroundRun::start(job_args, name);
  // Training, and committing checkpoints, before the signal.
  REQUIRE(wait_until([&] { return std::filesystem::exists(dir) && !commits_in(dir).empty(); }, 60));
  REQUIRE(live_processes_of(dir).size() >= 2);  // the supervisor and its job
  const pid_t supervisor = job.pid;
  REQUIRE(::kill(supervisor, sig) == 0);
  // A commit already past its last check when the signal landed may still
  // finish: the snapshot waits 50 ms for it. None may start after the
  // signal, where the job went on committing every few milliseconds.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const std::vector<int64_t> at_signal = commits_in(dir);
  const int rc = job.wait(30);
  CAPTURE(job.stderr_text());
  CHECK(rc == 128 + sig);  // the supervisor dies of the signal, as an interrupted command does
  if (sig != SIGKILL) {
    // Passed on and waited for: nothing of the job outlives its supervisor.
    CHECK(live_processes_of(dir).empty());
    CHECK(job.stderr_text().find("stopped the job") != std::string::npos);
    CHECK(ls::read_current_lease(*ls::open_store(dir.string())).released);  // the next job need not wait
  } else {
    // No handler sees SIGKILL: the job's processes notice on their own.
    CHECK(wait_until([&] { return live_processes_of(dir).empty(); }, 5));
    CHECK(job.stderr_text().find("the supervisor (pid " + std::to_string(supervisor) + ") is gone") != std::string::npos);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(commits_in(dir).back() == at_signal.back());
  CHECK(wait_until([&] { return std::filesystem::is_empty(job.tmpdir); }, 5));  // no lockstep-supervisor-* left
}

}  // namespace lstest
