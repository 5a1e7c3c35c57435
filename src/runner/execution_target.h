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

// Before the run, for the summary: at level local the libraries its products
// call (r.local_gemm, and r.local_gemm_bf16 at bf16; ops/local.h); at bf16
// on the engine's portable level the instruction-set path of its bf16
// products (r.gemm_bf16_path, ops/gemm_bf16.h). Returns the process's count
// of gemm_bf16 fallbacks so far, for count_gemm_bf16_fallbacks.
int64_t name_libraries(const ops::ExecutionTarget& t, Backend backend, RunResult& r);
// After the run: r.gemm_bf16_fallback_calls, the calls this process's
// gemm_bf16 handed from avx512-bf16 to avx512 since name_libraries.
void count_gemm_bf16_fallbacks(int64_t before, RunResult& r);

}  // namespace ls
