// What the blocks of one training step share (model/blocks.h): each layer's
// saved activations, the scratch reused from step to step, and the step's
// context -- shapes, weights and gradients, the mesh, the trace sink and
// the statistics. Internal to src/model.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/experts.h"
#include "model/model.h"
#include "ops/device_memory.h"
#include "trace/sink.h"

namespace ls {

// Saved activations of one layer plus the routing of its tokens. Buffers ops
// read or write are DeviceVectors (ops/device_memory.h); the rest is host
// bookkeeping. Shapes per rank: N tokens, K slots, E experts.
struct LayerActs {
  // Attention block.
  ops::DeviceVector<float> x;               // [N, D] the layer's input: the residual stream
  ops::DeviceVector<float> attn_in;         // [N, D] RMSNorm(x)
  ops::DeviceVector<float> attn_inv_rms;    // [N] that norm's 1/rms
  ops::DeviceVector<float> qkv;             // [N, 3D]
  ops::DeviceVector<float> attn_probs;      // per (sample, head): the causal softmax P
  ops::DeviceVector<uint16_t> attn_probs_bf16;  // or P kept as bf16 (probs_store, model/context_parallel.h)
  ops::DeviceVector<float> attn_out;        // [N, D] P V, before the output projection
  ops::DeviceVector<float> mid;             // [N, D] x + attention: the stream the MoE block reads
  // MoE routing.
  ops::DeviceVector<float> moe_in;          // [N, D] RMSNorm(mid): what the experts and the router read
  ops::DeviceVector<float> moe_inv_rms;     // [N]
  ops::DeviceVector<float> router_logits;   // [N, E]
  ops::DeviceVector<float> gates;           // [N, E] softmax of the logits
  ops::DeviceVector<float> router_lse;      // [N] their log-sum-exp (z-loss)
  ops::DeviceVector<int> sel;               // [N*K] expert of each (token, slot)
  // MoE dispatch.
  ops::DeviceVector<int64_t> row_of;        // [N*K] row of (token, slot) in the expert buffers
  // The experts' batch (expert_parallel.h, expert_batch): under a mesh.etp wider than mesh.tp, the token
  // group's selections, inputs and rows, gathered; batch_sel and batch_in point at them, or at sel and moe_in.
  ops::DeviceVector<int> batch_sel_all;
  ops::DeviceVector<float> batch_in_all;
  ops::DeviceVector<int64_t> batch_row_of_all;
  const int* batch_sel = nullptr;
  const float* batch_in = nullptr;
  std::vector<int64_t> expert_off;          // [E+1] first row of each expert
  std::vector<int64_t> row_token;           // [rows] token (in the experts' batch) of each expert row
  std::vector<int64_t> global_counts;       // [E] assignments per expert over every data-parallel rank
                                            // (pipelined: this microbatch's until the pipeline sets the step's)
  std::vector<float> router_partial;        // pipelined: this microbatch's router sums ([E] gates, lse^2,
                                            // and with moe.aux_scope=sequence the samples' losses)
  std::vector<int64_t> sample_counts;       // moe.aux_scope=sequence: [held stream samples, E] assignments
  // The round schedule: plans[d] is EP rank d's (every rank knows every
  // owner's, to place its rows); counts[src * E + e]: rows of EP rank src
  // for expert e. Without expert parallelism: one plan, counts = the loads.
  std::vector<RoundPlan> plans;
  std::vector<int64_t> counts;
  ExpertRows rows;                          // the rows of the experts held here (from every rank of the EP group)
  // MoE experts and combine.
  ops::DeviceVector<float> ye;              // [N*K, D] expert outputs in dispatch order
  const float* ye_rows = nullptr;           // = ye.data()
  ops::DeviceVector<float> shared_u, shared_v, shared_gate, shared_act;  // [N, F] the shared expert's SwiGLU
  ops::DeviceVector<float> shared_out;                                   // [N, D]
};

// Everything a model keeps allocated between steps.
struct StepWorkspace {
  int batch = -1;
  int microbatches = 0;                 // StageIo::microbatches of the forward that filled it
  int microbatch = 0;                   // and StageIo::microbatch
  std::vector<float> ce_partial;        // pipelined: [1] the cross-entropy sum over these tokens
  std::vector<LayerActs> layers;
  std::vector<float> aux_loss, z_loss;  // per layer, this step's
  ops::DeviceVector<float> h;           // [N, D] the stream after the last layer: the head's input
  // Head.
  ops::DeviceVector<float> final_out, final_inv_rms, logits, prob, lse, loss;
  // Backward scratch.
  ops::DeviceVector<float> dh;          // the gradient of the residual stream where the backward stands
  ops::DeviceVector<float> dtmp, dlogits, dye, dxe, dg, dz, dmoe_in, dattn_out, dqkv;
  ops::DeviceVector<float> shared_dact, shared_du, shared_dv, shared_dx;
  std::vector<float> trace_rows;               // expert rows regathered in (token, slot) order for the trace
  ops::DeviceVector<int> tok_id;               // [N] the input byte of each token
  ops::DeviceVector<int> target_id;            // [N] the next byte: each token's target
  ops::DeviceVector<int64_t> uniform_off;      // [leaves + 1] leaf offsets of whole leaves of tokens
  ops::DeviceVector<float> router_sums;        // [E + 1] ops::router_stats
  // MoE buffers sized by the schedule's capacity, reused by every round and layer.
  ExpertSlots slots;
  ops::DeviceVector<float> send, recv;          // expert parallel: one round's rows out and in
  ops::DeviceVector<int64_t> from_row, to_row;  // a round's row copies (ops::copy_rows): source and destination rows
  ops::DeviceVector<int64_t> keep_row;          // and, expert parallel, where each arriving row is kept
  std::vector<int64_t> piece_first_row, piece_rows;  // exchange_rows: per local expert, a source's part of a round
  // expert_parallel.h: a round's exchange started and not yet finished -- its all-to-all in flight, and
  // what finishing it does with the rows that arrive. No pending: none.
  struct ExchangeInFlight {
    Pending pending;
    std::function<void()> unpack;
  } exchange_in_flight;
  ops::DeviceVector<float> row_vector;          // a vector added to every row (router skew, aux-loss gradient)
  std::vector<ops::DeviceVector<float>> grad_state;  // LeafFold state per (expert, gradient)
  ExpertWeightGrads expert_grads;               // the backward's expert weight gradients, reused by every layer
  ops::DeviceVector<float> tp_partial;          // tensor parallel: a chained fold's partial outputs, packed
  // Sequence parallel: a stream tensor gathered over the TP group (norm output, dh) and the gradient of
  // the local tokens' expert outputs, packed for that gather.
  ops::DeviceVector<float> sp_gathered, sp_dh, sp_rows, sp_rows_all;
  ops::DeviceVector<int> sel_held;  // sequence parallel: the routing choices of this rank's stream tokens
  // Context parallel: rows packed for the group's all-gathers and broadcast, and one dK/dV link.
  ops::DeviceVector<float> cp_send, cp_recv, cp_link;
  ops::DeviceVector<float> cp_ds;  // the dS of this rank's query ranges, kept for the dK/dV chain's key blocks
  ops::DeviceVector<float> cp_pack;  // a share of a stream tensor's columns, packed for its fold (cp_columns)
  // Measured: the bytes every float buffer above holds allocated (capacities), the layers' included.
  int64_t allocated_bytes() const;
  // Swaps the backward scratch (dh ... shared_dx: read and written only
  // inside one backward pass) with `to`'s: a pipeline stage switching
  // microbatch workspaces carries one set along instead of one per
  // microbatch in flight.
  void hand_backward_scratch(StepWorkspace& to);
};

// Which rows of a traced buffer hold this rank's values of the logical
// [N, ...] tensor, N every token of the step in (sample, position) order.
enum class TraceRows {
  kTokens,  // every token this rank runs (ctx.tokens), from row 0
  kStream,  // the residual stream's tokens held here: stream_first.., from row 0
  kHeld,    // context parallel: this rank's positions of each sample (rows_held), at their rows
};
struct TraceLayout {
  TraceRows rows = TraceRows::kTokens;
  // > 0: tensor parallel splits the columns into this many parts of d_model
  // features each (q, k, v), the rank holding its heads' width_held() of each.
  int split_parts = 0;
};


// One step as the blocks see it.
struct StepContext {
  const ModelConfig& cfg;
  StepWorkspace& ws;
  MoeStats& stats;
  const std::vector<ParamInfo>& params;
  const float* weights;          // read (a lane reads its main model's)
  float* grads;                  // written by the backward
  const uint8_t* token_bytes;    // batch * (seq_len + 1): inputs, then the shifted targets (forward only)
  int batch = 0;
  int64_t tokens = 0;            // N = batch * seq_len on this rank
  int64_t leaf_tokens = 0;       // tokens per leaf of the canonical reduction tree
  int64_t leaves = 0;            // leaves on this rank
  int local_experts = 0;         // experts held here: experts / ep()
  // The residual stream's tokens held here: [stream_first, stream_first +
  // stream_tokens) of the N; all N but with sequence parallel (a TP rank's share).
  bool sp = false;
  int64_t stream_first = 0, stream_tokens = 0, stream_leaves = 0;
  int microbatches = 0;          // > 0: one microbatch of a pipeline (StageIo::microbatches)
  int microbatch = 0;            // which one
  // Expert parallel over several microbatches: per layer, the experts'
  // weight gradients kept per source rank across the step's microbatches.
  std::vector<ExpertGradsBySource>* source_grads = nullptr;
  bool grads_by_source() const { return microbatches > 1 && expert_sources() > 1; }
  // The data-parallel ranks whose rows an expert's owner folds: the EP group's, each with its token group's
  // (Axis::kExpertTokens, mesh.etp wider than mesh.tp).
  int expert_sources() const { return ep() * mesh->size(Axis::kExpertTokens); }
  float global_tokens = 0;       // N over every data-parallel rank (and microbatch)
  float global_assignments = 0;  // N * K over every data-parallel rank
  const Mesh* mesh = nullptr;    // this rank's groups (one-rank groups on one rank)
  TraceSink* trace = nullptr;    // nullptr: not traced (evaluation passes never are)
  bool debug_reorder_moe_norm = false;

  const float* weight(const std::string& name) const { return weights + param(name).offset; }
  float* grad(const std::string& name) const { return grads + param(name).offset; }
  const float* layer_weight(int layer, const char* name) const { return weight(layer_param(layer, name)); }
  float* layer_grad(int layer, const char* name) const { return grad(layer_param(layer, name)); }
  LayerActs& layer(int l) const { return ws.layers[(size_t)l]; }
  // The ranks along axis a (a one-rank group where the mesh has none).
  Communicator& group(Axis a) const { return mesh->group(a); }
  // The groups' sizes and this rank's place in them: data-parallel ranks,
  // the expert-parallel group (model/expert_parallel.h), the tensor-parallel
  // group (model/tensor_parallel.h), the context-parallel group
  // (model/context_parallel.h).
  int dp() const { return mesh->size(Axis::kData); }
  int ep() const { return mesh->size(Axis::kExpert); }
  int ep_rank() const { return mesh->rank(Axis::kExpert); }
  int tp() const { return mesh->size(Axis::kTensor); }
  int tp_rank() const { return mesh->rank(Axis::kTensor); }
  int cp() const { return mesh->size(Axis::kContext); }
  int cp_rank() const { return mesh->rank(Axis::kContext); }
  bool cp_zigzag() const { return mesh->cp_layout() == CpLayout::kZigzag; }
  // Tensor parallel: what this rank holds of the heads, their features and the hidden features.
  int heads_held() const { return cfg.n_heads / tp(); }
  int width_held() const { return cfg.d_model / tp(); }  // the model features of the heads held
  int d_ff_held() const { return cfg.d_ff / tp(); }  // the shared expert's hidden features held
  // The routed experts' hidden features held: split over their own group
  // (Mesh::expert_tensor_axis: the tensor group, or mesh.etp's).
  Axis expert_tensor_axis() const { return mesh->expert_tensor_axis(); }
  int expert_d_ff_held() const { return cfg.d_ff / mesh->size(expert_tensor_axis()); }

  // The residual stream entering layer l; l == n_layers: the head's input.
  float* stream(int l) const { return l < cfg.n_layers ? ws.layers[(size_t)l].x.data() : ws.h.data(); }
  // The plan of the experts held here, for layer l.
  const RoundPlan& own_plan(const LayerActs& acts) const { return acts.plans[(size_t)ep_rank()]; }

  // A tensor to the trace sink, if tracing: this rank's piece of it, as
  // `layout` says, shape[0] standing for the step's N. (One rank: the whole.)
  // dtype: how this backend holds the values (data: their fp32 form).
  void trace_tensor(const char* phase, int layer, const char* op, const char* name, const float* data,
                    std::vector<int64_t> shape, TraceLayout layout = {}, TraceDtype dtype = TraceDtype::kF32) const;
  // Expert rows in (token, slot) order, the layout the reference keeps (for the trace).
  const float* token_slot_order(const LayerActs& acts, const float* rows, int width) const;

 private:
  static std::string layer_param(int layer, const char* name) {
    return "layers." + std::to_string(layer) + "." + name;
  }
  const ParamInfo& param(const std::string& name) const;
};

}  // namespace ls
