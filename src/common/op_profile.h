// Time per kind of op, for the price list of determinism (tools/price-list):
// `lockstep run --profile-ops` adds to the summary the seconds each kind of op
// took, measured around the ops themselves. Only the outermost timed op on a
// thread counts (a linear layer's GEMM is not counted twice), and threads
// add up (thread-seconds: at one thread they are wall seconds). Off, a timer
// costs one relaxed atomic load.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace ls {

enum class OpKind {
  kGemm,         // forward and input-gradient matrix products
  kWeightGrad,   // weight gradients (reductions over tokens)
  kAttention,    // causal attention forward and backward
  kSoftmax,      // router and loss softmax, forward and backward
  kNorm,         // RMSNorm forward, backward, gain gradient
  kSwiglu,       // expert activations
  kMoeDispatch,  // rows to and from the expert slots (all-to-all under EP)
  kMoeCombine,   // gated sum of the experts' outputs and its backward
  kAdamw,        // the optimizer update
  kGradNorm,     // the global gradient norm
  kCopy,         // rows packed, unpacked and copied for a collective or a chain (not inside another op)
  kCount
};

inline const char* op_kind_name(OpKind k) {
  static const char* names[] = {"gemm",         "weight_grad", "attention", "softmax", "norm",     "swiglu",
                                "moe_dispatch", "moe_combine", "adamw",     "grad_norm", "copy"};
  return names[(int)k];
}

namespace op_profile_detail {
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{false};
  return on;
}
inline std::atomic<int64_t>* nanos() {
  static std::atomic<int64_t> ns[(int)OpKind::kCount] = {};
  return ns;
}
inline int& depth() {
  thread_local int d = 0;
  return d;
}
}  // namespace op_profile_detail

inline void set_op_profiling(bool on) { op_profile_detail::enabled().store(on, std::memory_order_relaxed); }
inline void reset_op_seconds() {
  for (int k = 0; k < (int)OpKind::kCount; ++k) op_profile_detail::nanos()[k].store(0);
}
// Seconds per kind since the last reset, by name.
inline std::map<std::string, double> op_seconds() {
  std::map<std::string, double> out;
  for (int k = 0; k < (int)OpKind::kCount; ++k)
    out[op_kind_name((OpKind)k)] = (double)op_profile_detail::nanos()[k].load() * 1e-9;
  return out;
}

// Times its scope as `kind` when profiling is on and no timed op encloses it.
class OpTimer {
 public:
  explicit OpTimer(OpKind kind) : kind_(kind) {
    if (!op_profile_detail::enabled().load(std::memory_order_relaxed)) return;
    entered_ = true;
    if (op_profile_detail::depth()++ == 0) {
      timing_ = true;
      t0_ = std::chrono::steady_clock::now();
    }
  }
  ~OpTimer() {
    if (timing_) {
      const auto ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
      op_profile_detail::nanos()[(int)kind_].fetch_add(ns, std::memory_order_relaxed);
    }
    if (entered_) --op_profile_detail::depth();
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  OpKind kind_;
  bool entered_ = false, timing_ = false;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace ls
