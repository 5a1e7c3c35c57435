// lockstep bisect's runs: each side of the comparison run as a child
// `lockstep run --json` process, so the two sides may be different
// binaries, in a scratch folder of its own.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/stop_signals.h"

namespace ls::bisect {

// One side of the comparison.
struct Side {
  std::string binary;
  nlohmann::json resolved;  // the full scenario
  std::string backend = "engine";
  int threads = 0;
  std::string mesh_fault;  // debug only: --debug-mesh-fault (dropped on one rank)
  std::string launcher = "threads";  // mpi: runs on more than one rank go under mpirun
};

// How one run of a side ended.
struct Child {
  int rc = -1;      // the exit code; -1 when killed by a signal
  int signal = 0;   // the signal that killed it, if one did
  nlohmann::json summary;  // the --json line
  std::string err;
};

// Runs the children in a temporary directory, which goes when the bisect
// ends, however it ends (a side that fails throws out of cmd_bisect).
class Runner {
 public:
  explicit Runner(std::filesystem::path dir) : dir_(std::move(dir)) {}
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Runs `side` for `steps`; trace written to `trace` when non-empty (with
  // --trace-dump `dump` when that is). A stop signal (Ctrl-C, kill) while
  // it runs is passed on to it and ends the bisect: Interrupted.
  Child run(const Side& side, int steps, const std::string& trace = "", const std::string& dump = "");
  int runs() const { return runs_; }
  const std::filesystem::path& dir() const { return dir_; }

 private:
  static pid_t spawn(const std::vector<std::string>& args, const std::filesystem::path& out,
                     const std::filesystem::path& err);
  int wait_for(pid_t pid) const;

  std::filesystem::path dir_;
  int n_ = 0, runs_ = 0;
  StopSignals stop_signals_;  // while the bisect runs
};

}  // namespace ls::bisect
