// What several subcommands share: run's options (plan takes a subset of
// them), the command line as given, and an atomic file write.
#pragma once

#include <string>
#include <vector>

namespace ls {

// `lockstep run`'s options; `plan` fills the ones it takes and sets dry_run.
struct RunArgs {
  std::string scenario;
  std::vector<std::string> sets;
  int threads = 0;
  std::string backend = "engine";
  int steps = -1;
  std::string out_dir;
  bool json = false, progress = false, quiet = false, dry_run = false, profile_ops = false;
  std::string trace, trace_dump, debug_reorder, resume;
  std::vector<std::string> faults;
  bool supervise = false;
  std::string fault_state, heartbeat, step_log;  // set by the supervisor for its child
  int supervisor_pid = 0;                        // the supervisor its child watches (runner/lifeline.h)
  std::string lease;                             // the supervisor's checkpoint lease, JOB:GENERATION
  bool resume_fallback_to_start = false;         // (the supervisor's restarts: RunOptions)
  int max_restarts = 8;
  double heartbeat_timeout = 120;
  std::vector<std::string> debug_bumps;
  std::string debug_mesh_fault;
  std::string launcher = "threads";
  std::vector<int> hash_at;  // (lockstep check --launcher mpi: the golden file's state-hash steps)
  std::vector<double> progress_log;  // (tests: FIRST,EVERY seconds of the not-a-terminal cadence)
};

// The command line as given (main keeps it), for --launcher mpi to hand to mpirun.
void keep_command_line(int argc, char** argv);
const std::vector<std::string>& command_line();

// Writes `text` to a temporary file beside `path`, then renames it over
// `path`: a reader never sees half a file. UserError naming `path` if it
// cannot be written.
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace ls
