// The precision a run's matrix products take (numerics.precision,
// docs/NUMERICS.md §10). `fp32`: every product in binary32, the contract's
// fma folds. `bf16`, the mixed-precision recipe of Megatron's --bf16: the
// operands of the model's matrix products (weights and activations, and
// their gradients) rounded to bf16, the products summed in fp32; master
// weights, optimizer state, norms, softmax, router, attention scores,
// loss and every reduction across ranks stay fp32.
//
// Process-wide, like the numerics level: the ranks of an in-process mesh
// are threads of one run. Installed for a run by ops::install (ops/dispatch.h).
#pragma once

#include <atomic>
#include <string>

namespace ls {

enum class Precision { kFp32, kBf16 };

inline std::atomic<int>& precision_slot() {
  static std::atomic<int> precision{0};
  return precision;
}
inline Precision precision() { return (Precision)precision_slot().load(std::memory_order_relaxed); }
// numerics.precision's value ("fp32" or "bf16", checked by the loader).
inline Precision precision_of(const std::string& key) { return key == "bf16" ? Precision::kBf16 : Precision::kFp32; }
inline bool bf16_matmuls() { return precision() == Precision::kBf16; }

}  // namespace ls
