// Which code runs an op. Two choices, made together for a run by install()
// (run_scenario's ScopedExecutionTarget) and by nothing else:
//   - the backend: the engine's own code, or a table of kernels (OpHooks,
//     kernels/hook_table.inc) that replaces it op by op: `cuda-emulated`
//     (the kernels on the CPU emulation of CUDA) and `cuda` (on a GPU);
//   - the numerics level (common/numerics_level.h): `portable`, the contract,
//     or `local` (ops/local.h on the engine; cuBLAS GEMMs in the `cuda`
//     backend's local table).
// Every op begins with the same lines, in this order:
//   if (auto k = kernel(&OpHooks::rmsnorm)) return k(x, w, y, r, N, D, eps);  // cuda, cuda-emulated
//   if (local_numerics()) return local::rmsnorm(x, w, y, r, N, D, eps);       // engine, local
//   ...the contract's code...                                                  // engine, portable
// An op without a kernel entry or without a local variant leaves that line
// out and runs its contract code there. The check is one load and branch.
//
// Process-wide: the ranks of an in-process mesh are threads of one run.
#pragma once

#include <atomic>

#include "common/numerics_level.h"
#include "common/precision.h"
#include "ops/device_memory.h"
#include "ops/hooks.h"

namespace ls::ops {

inline std::atomic<const OpHooks*>& op_hooks_slot() {
  static std::atomic<const OpHooks*> hooks{nullptr};
  return hooks;
}

// The installed kernel table, or nullptr (the engine's own ops).
inline const OpHooks* installed_kernels() { return op_hooks_slot().load(std::memory_order_relaxed); }

// The installed backend's kernel for one op, or nullptr: the engine's code runs it.
template <class Fn>
inline Fn kernel(Fn OpHooks::*op) {
  const OpHooks* h = installed_kernels();
  return h ? h->*op : nullptr;
}

// Everything that says where a run's ops run. The default is the engine, portable.
struct ExecutionTarget {
  const OpHooks* kernels = nullptr;      // nullptr: the engine's own ops
  const MemoryHooks* memory = nullptr;   // what DeviceVectors hold; nullptr: the heap
  const MemoryHooks* staging = nullptr;  // what StagingVectors hold; nullptr: the heap
  NumericsLevel level = NumericsLevel::kPortable;
  Precision precision = Precision::kFp32;  // numerics.precision
  const char* device = "";  // the GPU it runs on (`cuda`), for the summary
};

inline void install(const ExecutionTarget& t) {
  op_hooks_slot().store(t.kernels, std::memory_order_relaxed);
  memory_hooks_slot(MemoryKind::kDevice).store(t.memory, std::memory_order_relaxed);
  memory_hooks_slot(MemoryKind::kStaging).store(t.staging, std::memory_order_relaxed);
  numerics_level_slot().store((int)t.level, std::memory_order_relaxed);
  precision_slot().store((int)t.precision, std::memory_order_relaxed);
}

// Installs a target for a scope; however the scope ends, the process is back
// on the engine, portable (other work in the process, the next run).
class ScopedExecutionTarget {
 public:
  explicit ScopedExecutionTarget(const ExecutionTarget& t) { install(t); }
  ~ScopedExecutionTarget() { install(ExecutionTarget{}); }
  ScopedExecutionTarget(const ScopedExecutionTarget&) = delete;
  ScopedExecutionTarget& operator=(const ScopedExecutionTarget&) = delete;
};

}  // namespace ls::ops
