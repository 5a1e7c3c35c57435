// `lockstep faults sweep`: randomized kills across every phase, weighted
// toward checkpoint I/O, each run supervised and held to the golden hash.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ls {

struct SweepArgs {
  std::string scenario;
  std::vector<std::string> sets;
  int trials = 20;
  uint64_t seed = 1;
  bool store_faults = false;  // add transient store errors to some trials
  bool keep = false;          // keep the trial stores (no gc)
  int threads = 0;
  // "mpi": every trial is a supervised mpirun job, one rank per process; the
  // faults then kill a random rank's process (rank_crash), and no rank
  // process may outlive its trial.
  std::string launcher = "threads";
  bool json = false;  // one JSON object on stdout instead of the counts
  std::string junit;  // write JUnit XML here: one test case per trial
};

// Prints the counts; 0 when every trial ended on the golden hash.
int cmd_faults_sweep(const SweepArgs& a);

}  // namespace ls
