#include "runner/execution_target.h"

#include "common/error.h"
#include "emu/backend.h"
#include "ops/gemm_bf16.h"
#include "ops/local.h"
#include "runner/cuda_backend.h"

namespace ls {

ops::ExecutionTarget execution_target(Backend backend, NumericsLevel level, Precision precision) {
  const bool local = level == NumericsLevel::kLocal;
  ops::ExecutionTarget t;
  t.level = level;
  t.precision = precision;
  if (precision == Precision::kBf16) {
    // The local level's bf16 products are oneDNN's matmul (ops/local.h), on the engine only.
    if (local && backend == Backend::kEngine && !ops::local::have_gemm_bf16())
      throw UserError("numerics.level=local with numerics.precision=bf16 needs oneDNN's bf16 matmul, and this build "
                      "has no oneDNN (install libdnnl-dev, scripts/install-deps.sh, and rebuild); run "
                      "numerics.level=portable or numerics.precision=fp32");
    if (local && backend == Backend::kCuda)
      throw UserError("numerics.level=local with numerics.precision=bf16 runs on --backend engine only (the cuda "
                      "backend's local level has cuBLAS fp32 GEMMs, no bf16 path)");
  }
  switch (backend) {
    case Backend::kReference:  // runs none of the engine's ops
      if (local)
        throw UserError("numerics.level=local: the reference is the contract's definition and runs portable only; "
                        "use the engine backend");
      return t;
    case Backend::kEngine:
      return t;
    case Backend::kCudaEmulated:
      if (local)
        throw UserError("numerics.level=local: the emulated kernels are portable only (--backend cuda runs the local "
                        "level with cuBLAS)");
      t.kernels = &emu::kernel_hooks();
      t.memory = &emu::registered_memory();  // and every launch checks its pointers lie in it
      return t;
    case Backend::kCuda: {
      const cuda::Backend& gpu = open_cuda_backend();  // throws, saying why, without a usable GPU
      t.kernels = local ? gpu.local_hooks : gpu.hooks;  // local: cuBLAS GEMMs, the contract kernels for the rest
      t.memory = gpu.memory;                            // managed memory
      t.staging = gpu.pinned;                           // page-locked checkpoint staging
      t.device = gpu.device;
      return t;
    }
  }
  return t;
}

int64_t name_libraries(const ops::ExecutionTarget& t, Backend backend, RunResult& r) {
  if (t.level == NumericsLevel::kLocal) {
    r.local_gemm = ops::local::gemm_library();
    if (t.precision == Precision::kBf16) r.local_gemm_bf16 = ops::local::gemm_bf16_library();
  } else if (t.precision == Precision::kBf16 && backend == Backend::kEngine) {
    r.gemm_bf16_path = ops::bf16_path_name(ops::gemm_bf16_path());
  }
  return ops::gemm_bf16_tiny_fallbacks();
}

void count_gemm_bf16_fallbacks(int64_t before, RunResult& r) {
  if (!r.gemm_bf16_path.empty()) r.gemm_bf16_fallback_calls = ops::gemm_bf16_tiny_fallbacks() - before;
}

}  // namespace ls
