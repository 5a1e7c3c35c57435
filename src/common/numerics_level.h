// The numerics level a run declares (docs/NUMERICS.md §8). `portable` obeys
// the contract: bits depend on the math only. `local` computes the same model
// the way an ordinary fast trainer does (OpenBLAS GEMMs over all tokens at
// once, the C library's exp, reductions in a fixed order per thread count,
// ranks' sums left to right in rank order): bitwise run to run only at a
// fixed thread count and mesh, held to `portable` by tolerance.
//
// Process-wide: the ranks of an in-process mesh are threads of one run.
// Installed with the backend for a run by ops::install (ops/dispatch.h).
#pragma once

#include <atomic>
#include <string>

namespace ls {

enum class NumericsLevel { kPortable, kLocal };

inline std::atomic<int>& numerics_level_slot() {
  static std::atomic<int> level{0};
  return level;
}
inline NumericsLevel numerics_level() { return (NumericsLevel)numerics_level_slot().load(std::memory_order_relaxed); }
inline bool local_numerics() { return numerics_level() == NumericsLevel::kLocal; }

}  // namespace ls
