// lockstep faults: fault injection tools. Its one verb, sweep, runs in
// faults_sweep.cc; this file gives it its options.
#include <CLI/CLI.hpp>
#include <memory>

#include "cli/commands.h"
#include "cli/faults_sweep.h"

namespace ls {

Command faults_command(CLI::App& cmd) {
  auto args = std::make_shared<SweepArgs>();
  SweepArgs& sa = *args;
  cmd.require_subcommand(1);
  auto* sweep = cmd.add_subcommand(
      "sweep", "kill supervised runs at random points (weighted toward checkpoint I/O); every one must end on the "
               "fault-free final_state_hash (exit 1 otherwise)");
  sweep->add_option("scenario", sa.scenario, "scenario JSON file")->required();
  sweep->add_option("--set", sa.sets, "override a scenario key (repeatable)");
  sweep->add_option("--trials", sa.trials, "runs (default 20)");
  sweep->add_option("--seed", sa.seed, "seed of the fault placement");
  sweep->add_flag("--store-faults", sa.store_faults, "also inject transient store errors in some trials");
  sweep->add_flag("--keep", sa.keep, "keep the trial checkpoints (no gc)");
  sweep->add_option("--threads", sa.threads, "threads per run")->check(CLI::Range(1, 1024));
  sweep->add_flag("--json", sa.json,
                  "print one JSON object instead of the counts: the counts and, per trial, its faults, outcome and "
                  "for a failure the first differing step and field");
  sweep->add_option("--junit", sa.junit,
                    "also write JUnit XML here for CI: one test case per trial, a failure naming the first differing "
                    "step and field");
  sweep->add_option("--launcher", sa.launcher,
                    "threads (default: ranks are threads of each run's process) or mpi (each trial an mpirun job, one "
                    "process per rank; kills hit random rank processes)");
  return [args] { return cmd_faults_sweep(*args); };
}

}  // namespace ls
