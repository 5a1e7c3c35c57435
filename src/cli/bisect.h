// `lockstep bisect`: from two runs that disagree to the first divergent
// step/op/tensor/element and the smallest set of differences that causes it.
#pragma once

#include <string>
#include <vector>

namespace ls {

struct BisectArgs {
  std::string scenario_a, scenario_b;  // b empty: the same scenario
  std::vector<std::string> sets_a, sets_b;
  std::string backend_a = "engine", backend_b = "engine";
  std::string bin_a, bin_b;            // empty: this binary
  int threads_a = 0, threads_b = 0;
  int steps = 0;                       // 0: the scenario's train.steps
  std::string keep;                    // copy the traces here
  std::string debug_mesh_fault_b;      // debug only: run B plants this mesh fault (lockstep run --debug-mesh-fault)
  bool json = false;                   // stdout: one JSON object (the report's lines go to stderr)
  std::string launcher = "threads";    // mpi: a multi-rank side's runs under mpirun, one process per rank
};

// Prints the report (--json: one object on stdout); returns 0 when the runs
// agree, 1 when they differ.
int cmd_bisect(const BisectArgs& a);

}  // namespace ls
