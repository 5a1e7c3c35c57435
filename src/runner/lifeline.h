// A supervised child's lifeline to its supervisor. The supervisor starts
// every process of its job (the in-process child, or mpirun's ranks) with
// its own pid; each of them watches that process and, the moment it is gone
// -- SIGKILL included, which no handler sees -- ends itself without
// committing anything more. So a job never outlives its supervisor, and a
// user who relaunches never races an orphan for the same checkpoint prefix.
#pragma once

#include <string>

namespace ls {

// Exit code of a child that found its supervisor gone.
constexpr int kExitSupervisorLost = 89;

// Starts watching process `supervisor_pid` (this process must not be it) on
// a thread of its own: pidfd_open(2) where the kernel has it, else a poll of
// the pid every 100 ms. When it ends, prints one line on stderr, removes
// `cleanup_dir` (the supervisor's scratch directory; "" for none) and calls
// _exit(kExitSupervisorLost): no destructor, no uploader and no commit runs
// after that. Without pidfds, when the supervisor is this process's parent,
// the kernel's parent-death signal (SIGKILL) backs the poll up. Returns at
// once; if the supervisor is already gone, does not return.
void watch_supervisor(int supervisor_pid, const char* cleanup_dir);

// The last check before a manifest is written: returns while the watched
// supervisor lives (or none is watched). Once it is gone -- checked again,
// not only from the watch thread -- ends this process as the watch thread
// would (one line, cleanup_dir removed, exit kExitSupervisorLost), so the
// job never exits through an error path with the scratch directory half
// removed.
void require_supervisor();

// What a supervised child tells its supervisor (rank 0's process alone):
// the heartbeat, the step being run, written at each step's start and
// renamed into place so that a kill mid-write never leaves it empty; and
// the step log, one line per finished step or evaluation, appended and
// closed at once so that a child killed right after leaves it in the log.
// An empty path: not supervised, nothing written.
void write_heartbeat(const std::string& path, int step);
void append_step_log(const std::string& path, const std::string& line);

}  // namespace ls
