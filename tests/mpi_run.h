// Runs `lockstep run` of the tiny scenario for the mpi suites, in one
// process or under mpirun: exit code, stderr and the --json summary.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "cluster/mpi.h"
#include "tiny_scenario.h"

namespace lstest {

inline const std::string kTiny = tiny_scenario(true);

struct Run {
  int rc = -1;
  std::string hash, err;
  std::vector<std::string> loss_bits;
  nlohmann::json summary;
};

// `lockstep run` of the tiny scenario; under mpirun with np > 0.
inline Run run_lockstep(int np, const std::string& args) {
  const auto sc = write_temp("mpi_tiny.json", kTiny);
  std::string cmd;
  if (np > 0)
    for (const std::string& w : ls::mpirun_command(np)) cmd += w + " ";
  cmd += std::string(LOCKSTEP_BIN) + " run " + sc.string() + " --json --quiet --threads 1 " + args;
  const auto out = cli_temp_dir() / "mpi-run.out", err = cli_temp_dir() / "mpi-run.err";
  const int status = std::system(("timeout 300 " + cmd + " >" + out.string() + " 2>" + err.string()).c_str());
  Run r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.err = slurp(err);
  std::string text = slurp(out);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  const size_t nl = text.rfind('\n');
  if (r.rc == 0 && !text.empty()) {
    r.summary = nlohmann::json::parse(nl == std::string::npos ? text : text.substr(nl + 1));
    r.hash = r.summary["final_state_hash"];
    r.loss_bits = r.summary["loss_bits"].get<std::vector<std::string>>();
  }
  return r;
}

}  // namespace lstest
