// The command line's two ways of starting an mpirun job, one process per
// mesh rank: run --launcher mpi hands this process over to one, and check
// --launcher mpi runs each multi-rank variant as one.
#pragma once

#include <string>

#include "runner/runner.h"
#include "runner/scenario.h"

namespace ls {

// run --launcher mpi: runs `mpirun -np <world> lockstep ...` with this
// command line (less --launcher) and ends as it ends: its exit code, or
// the signal that stopped it.
[[noreturn]] void launch_under_mpirun(const Scenario& s, const char* self);

// check --launcher mpi: `mpirun -np <world> lockstep run <spath>`, recording
// the golden file's state-hash steps; its summary, as the RunResult
// compare_golden reads. UserError with the job's stderr when it fails.
RunResult run_under_mpirun(const std::string& spath, const Scenario& s, int threads);

}  // namespace ls
