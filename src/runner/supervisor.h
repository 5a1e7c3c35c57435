// The supervisor: runs a training job as a child process, detects failure
// (exit, signal, or a heartbeat that stops -- a hang), and restarts it from
// the latest committed checkpoint, within a restart budget and with backoff.
// The role Ray plays in the large-lab reports this follows.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runner/processes.h"

namespace ls {

struct SuperviseOptions {
  std::string binary;                  // the lockstep binary to run as the child
  std::string scenario;                // scenario file
  std::vector<std::string> sets;       // --set overrides
  std::vector<std::string> faults;     // --fault specs (in addition to the scenario's faults list)
  int threads = 0;
  int max_restarts = 8;
  double heartbeat_timeout = 120;      // seconds without a new step: a hang
  double backoff_seconds = 0.05;       // base of the exponential backoff (with jitter)
  bool progress = true;                // the timeline on stderr
  bool announce_restarts = true;       // one line on stderr per restart, even without progress
  std::vector<std::string> extra_args; // passed to every child (e.g. --steps)
  std::string resume;                  // --resume URL[@STEP]: where the job starts (restarts use ckpt.url)
  bool child_progress = false;         // children print their progress lines (stderr inherited)
  bool child_quiet = true;             // else children print none; neither: as an unsupervised run would
  std::string child_stderr;            // append the children's stderr here (empty: inherit)
  // "mpi": each attempt is `mpirun -np mesh.dp lockstep run ...`, one rank per
  // process, started in a session of its own; whatever way it ends, every
  // process left in that session is killed before the next attempt.
  std::string launcher = "threads";
  // A caller whose job's checkpoints are its own scratch (faults sweep):
  // called on a stop signal, once the job is down; it cleans up and returns
  // what to say instead of "continue with --resume URL".
  std::function<std::string()> on_stop;
};

struct SuperviseResult {
  int exit_code = 0;                   // 0 ok; else the failing child's (2 bad input, 3 storage, ...)
  // On success, an unsupervised run's summary for the whole job: losses and
  // evaluations of every step (whichever attempt ran it), speed over every
  // attempt's steps; plus "restarts", "faults_fired", "attempts".
  nlohmann::json summary;
  std::string error;                   // why it gave up
};

// Checkpoint URL of a scenario after overrides (what restarts resume from).
SuperviseResult supervise(const SuperviseOptions& opt);

// session_processes and live_processes_matching: runner/processes.h.


}  // namespace ls
