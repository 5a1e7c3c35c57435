// The one place a run's backend (--backend) and numerics level
// (numerics.level) are chosen together: which kernel table, memory and level
// the engine's ops run with (ops/dispatch.h). run_scenario installs the
// result for the run.
#pragma once

#include "common/numerics_level.h"
#include "common/precision.h"
#include "ops/dispatch.h"
#include "runner/runner.h"

namespace ls {

// Throws UserError for a combination that does not exist (local on the
// reference or on the emulated kernels; bf16 off the engine and the
// reference, or at level local in a build without oneDNN) and, for `cuda`,
// without a usable GPU.
ops::ExecutionTarget execution_target(Backend backend, NumericsLevel level, Precision precision = Precision::kFp32);

// At level local, the libraries its products call, for the summary
// (r.local_gemm, and r.local_gemm_bf16 at bf16; ops/local.h).
void name_local_libraries(const ops::ExecutionTarget& t, RunResult& r);

}  // namespace ls
