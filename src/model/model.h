// The engine's MoE transformer: byte embedding + learned positions, pre-norm
// RMSNorm, causal multi-head attention, a top-k routed SwiGLU MoE FFN in every
// layer (optional shared expert), final norm, output head, cross-entropy,
// Switch load-balancing and router z-loss. Forward and backward are written
// by hand; bits equal reference/ for any thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "trace/sink.h"

namespace ls {

// One named parameter tensor inside the flat parameter array.
struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // into the flat arrays
  int64_t size = 0;
  bool decay = true;   // AdamW weight decay applies (matrices, not norms)
};

struct StepLosses {
  float ce = 0;     // mean cross-entropy, nats per byte
  float aux = 0;    // sum over layers of the load-balancing loss
  float z = 0;      // sum over layers of the router z-loss
  float total = 0;  // ce + aux_w * aux + z_w * z
};

// Routing statistics of the last forward pass.
struct MoeStats {
  std::vector<int64_t> tokens_per_expert;  // layer-major: [layer * experts + e]
};

// Model FLOPs per token of one training step (forward + backward ~ 3x the
// forward), counting the k routed experts evaluated and causal attention.
double train_flops_per_token(const ModelConfig& cfg);

class MoeTransformer {
 public:
  // Parameters drawn by the contract init (Philox, purpose kInit), the same
  // values the reference draws. leaf_samples fixes the token-reduction tree.
  MoeTransformer(const ModelConfig& cfg, int leaf_samples, uint64_t seed);
  ~MoeTransformer();
  MoeTransformer(const MoeTransformer&) = delete;
  MoeTransformer& operator=(const MoeTransformer&) = delete;

  // tokens: batch * (seq_len + 1) bytes per sample (inputs, then the shifted
  // targets). forward() evaluates; forward_backward() also overwrites grads().
  StepLosses forward(const uint8_t* tokens, int batch);
  StepLosses forward_backward(const uint8_t* tokens, int batch);

  const ModelConfig& config() const { return cfg_; }
  const std::vector<ParamInfo>& params() const { return infos_; }  // canonical order
  const ParamInfo& param(const std::string& name) const;
  float* weights() { return w_.data(); }
  const float* weights() const { return w_.data(); }
  float* grads() { return g_.data(); }
  const float* grads() const { return g_.data(); }
  int64_t num_weights() const { return (int64_t)w_.size(); }
  const MoeStats& moe_stats() const { return stats_; }
  // Tensors of forward_backward() go to `sink` (nullptr: no tracing).
  void set_trace(TraceSink* sink) { trace_ = sink; }
  // Debug only: fold the MoE RMSNorm's sum of squares in descending feature
  // order, a deliberate contract violation that drift tools must locate.
  void set_debug_reorder_moe_norm(bool on) { debug_reorder_moe_norm_ = on; }
  double train_flops_per_token() const { return ls::train_flops_per_token(cfg_); }

 private:
  struct Workspace;
  StepLosses run(const uint8_t* tokens, int batch, bool backward);

  ModelConfig cfg_;
  int leaf_samples_;
  std::vector<ParamInfo> infos_;
  std::vector<float> w_, g_;
  MoeStats stats_;
  Workspace* ws_ = nullptr;
  TraceSink* trace_ = nullptr;
  bool debug_reorder_moe_norm_ = false;
};

}  // namespace ls
