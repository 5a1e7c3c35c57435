// The engine's MoE transformer: byte embedding + learned positions, pre-norm
// RMSNorm, causal multi-head attention, a top-k routed SwiGLU MoE FFN in every
// layer (optional shared expert), final norm, output head, cross-entropy,
// Switch load-balancing and router z-loss. Forward and backward are written
// by hand; bits equal reference/ for any thread count.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cluster/mesh.h"
#include "model/config.h"
#include "model/experts.h"
#include "model/param_layout.h"
#include "ops/device_memory.h"
#include "trace/sink.h"

namespace ls {

// The passes of a training step, as a phase hook sees them (fault
// injection triggers on them).
enum class TrainPhase { kForward, kBackward, kOptimizer };

struct StepLosses {
  float ce = 0;     // mean cross-entropy, nats per byte
  float aux = 0;    // sum over layers of the load-balancing loss
  float z = 0;      // sum over layers of the router z-loss
  float total = 0;  // ce + aux_w * aux + z_w * z
};

// ce + aux_loss_weight * aux + z_loss_weight * z.
float total_loss(const ModelConfig& cfg, const StepLosses& l);

// A layer's load-balancing loss E * sum_e f_e P_e and z-loss mean(lse^2),
// from the step's router sums (ops::router_stats: per expert the gate sum,
// then the sum of lse^2) and its assignments per expert (f_e = counts[e] /
// global_assignments, P_e = sums[e] / global_tokens). With
// moe.aux_scope=sequence the sums hold one more entry, the step's samples'
// losses (sequence_balance), and aux is their mean. Reduces over the expert index e.
struct LayerBalance {
  float aux = 0, z = 0;
};
LayerBalance layer_balance(const ModelConfig& cfg, const float* router_sums, const int64_t* counts,
                           float global_tokens, float global_assignments);

// moe.aux_scope=sequence: the load-balancing loss of each of `samples`
// consecutive samples of seq_len tokens, E * sum_e f_se P_se with f_se =
// counts[s * E + e] / (seq_len K) and P_se = (a sequential fold of the
// sample's gates g_e) / seq_len, summed as a token reduction (in order inside
// each leaf of leaf_samples samples, leaves by the canonical tree). Fills
// counts (samples x E, the sample's assignments per expert) from sel (K per
// token) and returns the sum: the layer's loss is its total over the global
// batch divided by the batch's samples. Reduces over the expert index e.
float sequence_balance(const float* gates, const int* sel, int64_t samples, int seq_len, int experts, int top_k,
                       int64_t leaf_samples, std::vector<int64_t>& counts);

// The residual stream's per-token ops: at mesh.cp > 1 each runs on the
// rank's own positions only (model/context_parallel.h stream_rows), and
// MoeStats counts the rows each ran on.
enum class StreamOp { kEmbed, kAttnNorm, kAttnResidual, kMoeNorm, kRouter, kCombine, kDispatchSum, kFinalNorm, kHead };
constexpr int kStreamOps = 9;
static_assert((int)StreamOp::kHead + 1 == kStreamOps, "kStreamOps counts StreamOp");
const char* stream_op_name(StreamOp op);

// Routing statistics of the last forward pass.
struct MoeStats {
  std::vector<int64_t> tokens_per_expert;  // layer-major: [layer * experts + e], this rank's tokens
  // What the step executed (forward and backward), counted as it ran.
  int rounds = 0;                          // most rounds any layer ran
  int64_t borrowed = 0, dropped = 0;       // rows computed in lent slots / skipped, summed over layers
  int64_t expert_gemm_calls = 0;           // GEMM calls of the experts (rows, then weight gradients)
  int64_t all_to_all_calls = 0;            // expert-parallel exchanges, metadata and per round
  int64_t all_to_all_started = 0;          // of those, started to hide behind the shared expert (mesh.overlap)
  int64_t all_to_all_bytes = 0;            // bytes this rank sent in them
  // Measured: high-water marks of the bytes allocated, since the model was made.
  int64_t peak_expert_bytes = 0;           // the capacity-sized expert slots
  int64_t peak_dispatch_bytes = 0;         // the per-round all-to-all send and receive buffers
  int64_t peak_routed_bytes = 0;           // what is kept per routed row (u, v, inputs, outputs) for the backward
  int64_t peak_grad_state_bytes = 0;       // leaf-tree state of gradients spanning rounds
  // Measured: what the model holds, in bytes, after its last step.
  int64_t workspace_bytes = 0;             // activations and scratch: the allocated size of every step buffer
  int64_t weight_bytes = 0;                // parameters and their gradients (the rank's slices)
  // Context parallel, this step (measured): seconds computing this rank's
  // share of the attention blocks (its positions' projections, attention and
  // their gradients, its weight-gradient columns; waits for the group
  // excluded), and the bytes it handed the group (payload times receivers):
  // all of them, and those of K, V, dK and dV.
  double cp_attention_seconds = 0;
  int64_t cp_bytes_sent = 0, cp_kv_bytes_sent = 0;
  int64_t cp_link_messages = 0;  // the dK/dV chain's messages this rank sent (a key block of a head group each)
  // Rows each per-token op of the stream ran on this step, forward and backward (StreamOp's order).
  std::array<int64_t, kStreamOps> stream_rows{};
};

// What a training step keeps allocated for `batch` samples on one rank, in bytes: a
// formula (not a measurement) that mirrors the resize calls of model.cc and
// experts.cc. Buffers keep their capacity across steps, so this is what a
// model holds from its first training step on. Expert rows are counted at
// batch * seq_len * top_k per rank: exact without expert parallelism, the
// average with it.
struct WorkspaceEstimate {
  int64_t activations = 0;       // saved per-layer activations and backward scratch: n_layers * per_layer + scratch
  int64_t per_layer = 0, scratch = 0;
  int64_t backward_scratch = 0;  // of scratch, the backward's own: one set per pipeline stage, not per microbatch
  int64_t expert_buffers = 0;    // rows kept per routed row, and the capacity-sized expert slots
  int64_t dispatch_buffers = 0;  // expert parallel: one round's send and receive buffers
};
// probs_bytes: the bytes of each entry of attention's P as kept, 4 or (the
// CPU engine at numerics.precision=bf16, model/context_parallel.h) 2.
WorkspaceEstimate estimate_workspace(const ModelConfig& cfg, int batch, int ep_size, int probs_bytes = 4);
// Model FLOPs per token of one training step (forward + backward ~ 3x the
// forward), counting the k routed experts evaluated and causal attention.
double train_flops_per_token(const ModelConfig& cfg);

// What a range of blocks [first, last) exchanges with the ranges before and
// after it (MoeTransformer::forward_range).
struct StageIo {
  const float* stream_in = nullptr;  // [batch * seq_len, d_model]: the residual stream entering block `first` (first > 0)
  float* stream_out = nullptr;       // written: the stream entering block `last` (last < num_blocks)
  StepLosses carried;                // the loss sums of the blocks before `first`
  // > 0: one of a pipeline's `microbatches` microbatches (the step's tokens
  // are that many times these). The sums over tokens that span microbatches
  // are then left as this microbatch's partials (MoeTransformer::
  // ce_partial, router_partial, expert_counts) for the pipeline to combine,
  // and no losses are computed. 0: the whole step, sums done inside it.
  int microbatches = 0;
  int microbatch = 0;  // which one (a pipeline runs a chunk's microbatches in order)
};

// The model's blocks in forward order: the embedding, then these five per
// layer, then the head. Block indices follow from them.
enum class LayerPart { kAttention, kRouting, kDispatch, kExperts, kCombine };
constexpr int kBlocksPerLayer = 5;
// The index of layer `layer`'s `part`; layer_block(n_layers, kAttention) is the head's.
constexpr int layer_block(int layer, LayerPart part) { return 1 + kBlocksPerLayer * layer + (int)part; }

class Block;
struct StepContext;
struct StepWorkspace;

class MoeTransformer {
 public:
  // Parameters drawn by the contract init (Philox, purpose kInit), the same
  // values the reference draws. leaf_samples fixes the token-reduction tree.
  // placed: its tensors as a rank holds them (place_params; empty: the
  // whole model, one rank). held_blocks: a pipeline stage's blocks; only
  // their parameters are held (empty: every block's).
  MoeTransformer(const ModelConfig& cfg, int leaf_samples, uint64_t seed, std::vector<ParamInfo> placed = {},
                 const std::vector<int>& held_blocks = {});
  // The block that reads parameter `param` (an index into block_names()).
  static int block_of(const ModelConfig& cfg, const std::string& param);
  // A model that reads `main`'s weights (no copy, no init) and has gradients
  // and a workspace of its own: a data-parallel lane (runner/data_lanes.h).
  static std::unique_ptr<MoeTransformer> lane_of(const MoeTransformer& main);
  // This rank's groups (cluster/mesh.h); nullptr: one rank. Its groups must
  // be the mesh the model was placed on.
  void set_mesh(const Mesh* mesh) { mesh_ = mesh ? mesh : &one_rank_; }
  ~MoeTransformer();
  MoeTransformer(const MoeTransformer&) = delete;
  MoeTransformer& operator=(const MoeTransformer&) = delete;

  // tokens: batch * (seq_len + 1) bytes per sample (inputs, then the shifted
  // targets). forward() evaluates; forward_backward() also overwrites grads().
  StepLosses forward(const uint8_t* tokens, int batch);
  StepLosses forward_backward(const uint8_t* tokens, int batch);

  // The model as blocks (model/blocks.h), in forward order: "embedding",
  // then per layer "layers.L.attention", ".moe_routing", ".moe_dispatch",
  // ".moe_experts", ".moe_combine", then "head".
  int num_blocks() const { return (int)blocks_.size(); }
  std::vector<std::string> block_names() const;
  // One step over blocks [first, last) only, as a pipeline stage runs it:
  // the same bits as the whole step, block for block. A range begins and
  // ends where only the residual stream crosses (before the embedding, a
  // layer's attention or MoE routing, the head, or at the end); elsewhere
  // UserError. The forward takes its input stream (and the loss sums so
  // far) from io and writes the stream it hands on; the training backward
  // (after a training forward of the same range) takes the gradient of
  // that output stream (grad_out; nullptr when the range ends with the
  // head) and writes the gradient of its input stream (grad_in; nullptr when
  // it begins with the embedding). Gradients of the range's parameters only
  // are written. The losses: ce and total once the head has run.
  StepLosses forward_range(const uint8_t* tokens, int batch, bool training, int first, int last, const StageIo& io);
  void backward_range(int first, int last, const float* grad_out, float* grad_in);

  // A pipeline keeps one workspace (activations and scratch) per microbatch
  // in flight: the next forward_range / backward_range use workspace
  // `slot` (made on first use; 0 at construction).
  void use_workspace(int slot);
  int64_t workspace_bytes() const;  // measured: the allocated bytes of every workspace
  // The execution statistics start over (forward_range does this itself when not pipelined).
  void begin_step();
  // Pipelined (StageIo::microbatches > 0), after the current workspace's
  // forward: its partial sums, subtrees of the contract's leaf tree over
  // this microbatch's tokens. The cross-entropy sum (after the head); a
  // layer's router sums ([E] gate sums, then the lse^2 sum) and its
  // assignments per expert. Before that layer's backward, when the aux loss
  // weighs in, the step's counts over every microbatch and rank go back.
  float ce_partial() const;
  const std::vector<float>& router_partial(int layer) const;
  const std::vector<int64_t>& expert_counts(int layer) const;
  void set_expert_counts(int layer, const std::vector<int64_t>& counts);

  const ModelConfig& config() const { return cfg_; }
  const std::vector<ParamInfo>& params() const { return infos_; }  // canonical order
  const ParamInfo& param(const std::string& name) const;
  float* weights() { return w_at_ ? w_at_ : w_.data(); }
  const float* weights() const { return w_at_ ? w_at_ : w_.data(); }
  float* grads() { return g_at_ ? g_at_ : g_.data(); }
  const float* grads() const { return g_at_ ? g_at_ : g_.data(); }
  int64_t num_weights() const { return n_weights_; }
  // The weights and gradients move to memory the caller provides and keeps
  // alive (num_weights() floats each, 64-byte aligned): ranks sharing one
  // host's memory (runner/cluster_shared.cc). Nothing is copied: the caller
  // fills the weights before the next pass, which overwrites the gradients.
  void place_storage(float* weights, float* grads);
  const MoeStats& moe_stats() const { return stats_; }
  // The statistics of a step that other models ran in data-parallel lanes
  // (each over consecutive samples): tokens per expert summed; what they
  // executed summed (rounds: the most; MoE buffers: the largest lane's; the
  // workspace and weight bytes: this model's and every lane's together).
  void set_moe_stats_from_lanes(const std::vector<const MoeStats*>& lanes);
  // Tensors of forward_backward() go to `sink` (nullptr: no tracing).
  // state: also the weights before and the gradients after (one rank; a
  // mesh's trainer traces its assembled state instead).
  void set_trace(TraceSink* sink, bool state = true) {
    trace_ = sink;
    trace_state_ = state;
  }
  // Debug only: fold the MoE RMSNorm's sum of squares in descending feature
  // order, a deliberate contract violation that drift tools must locate.
  void set_debug_reorder_moe_norm(bool on) { debug_reorder_moe_norm_ = on; }
  bool debug_reorder_moe_norm() const { return debug_reorder_moe_norm_; }
  // Called with kForward and kBackward as a training pass enters each
  // (fault injection triggers on it); empty: none.
  void set_phase_hook(std::function<void(TrainPhase)> hook) { phase_hook_ = std::move(hook); }
  // Called around the blocks of a pass, with the block index: before_forward
  // as a forward enters the block (a trainer waits there for its weights),
  // after_backward once its backward wrote the gradients of the block's
  // parameters (block_of), its kernels done (a trainer starts their
  // reduction there). Empty: none.
  struct BlockHooks {
    std::function<void(int)> before_forward, after_backward;
  };
  void set_block_hooks(BlockHooks hooks) { block_hooks_ = std::move(hooks); }
  double train_flops_per_token() const { return ls::train_flops_per_token(cfg_); }

 private:
  struct LaneTag {};
  MoeTransformer(const MoeTransformer& main, LaneTag);
  StepLosses run(const uint8_t* tokens, int batch, bool training);
  // The step's context for blocks; tokens: nullptr in a backward.
  StepContext step_context(const uint8_t* tokens, int batch, bool training);
  void check_range(int first, int last) const;
  void check_placement() const;
  int64_t storage_bytes() const;

  ModelConfig cfg_;
  int leaf_samples_;
  std::vector<ParamInfo> infos_;
  ops::DeviceVector<float> w_, g_;  // weights and gradients: where the backend's kernels read them
  float *w_at_ = nullptr, *g_at_ = nullptr;  // place_storage's memory instead of w_ and g_
  int64_t n_weights_ = 0;
  const float* wsrc_ = nullptr;  // a lane reads its main model's weights; nullptr: its own
  MoeStats stats_;
  std::vector<std::unique_ptr<StepWorkspace>> workspaces_;
  std::vector<ExpertGradsBySource> source_grads_;  // per layer: expert parallel in a pipeline (experts.h)
  StepWorkspace* ws_ = nullptr;  // the one in use
  std::vector<std::unique_ptr<Block>> blocks_;
  TraceSink* trace_ = nullptr;
  bool trace_state_ = true;
  Mesh one_rank_;  // the mesh of a model on its own
  const Mesh* mesh_ = &one_rank_;
  bool debug_reorder_moe_norm_ = false;
  std::function<void(TrainPhase)> phase_hook_;
  BlockHooks block_hooks_;
};

}  // namespace ls
