// The live processes of this machine, as /proc lists them (Linux): what a
// supervisor checks is gone after it ends a job, and what tests check.
#pragma once

#include <string>
#include <vector>

namespace ls {

// Processes in session `sid` (this process excluded), by pid: what a job
// started with setsid left running. Linux /proc.
std::vector<int> session_processes(int sid);
// Live processes (this one excluded) whose command line, its arguments
// separated by NUL bytes as /proc/PID/cmdline holds them, contains `text`.
std::vector<int> live_processes_matching(const std::string& text);

}  // namespace ls
