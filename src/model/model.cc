// The engine's model: its parameters, and a step as a loop over its
// blocks (model/blocks.h), each of which names the reference block it must
// match bit for bit. Threads split only independent outputs (tokens,
// heads, expert row blocks, weight-gradient column slabs), never a fold.
#include "model/model.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/error.h"
#include "common/parallel.h"
#include "contract.h"
#include "model/blocks.h"
#include "model/context_parallel.h"
#include "model/step_context.h"
#include "ops/attention.h"
#include "ops/ops.h"

namespace ls {

namespace {

}  // namespace

int MoeTransformer::block_of(const ModelConfig& cfg, const std::string& param) {
  if (param == "tok_emb" || param == "pos_emb") return 0;
  if (param == "final_norm" || param == "lm_head") return layer_block(cfg.n_layers, LayerPart::kAttention);  // the head
  const size_t dot = param.find('.', 7);  // "layers.L.<name>"
  const int layer = std::stoi(param.substr(7, dot - 7));
  const std::string name = param.substr(dot + 1);
  if (name == "attn_norm" || name == "wqkv" || name == "wo") return layer_block(layer, LayerPart::kAttention);
  if (name == "moe_norm" || name == "router") return layer_block(layer, LayerPart::kRouting);
  if (name.rfind("experts.", 0) == 0) return layer_block(layer, LayerPart::kExperts);
  return layer_block(layer, LayerPart::kCombine);  // shared.*: the combine block runs the shared expert
}

MoeTransformer::MoeTransformer(const ModelConfig& cfg, int leaf_samples, uint64_t seed, std::vector<ParamInfo> placed,
                               const std::vector<int>& held_blocks)
    : cfg_(cfg), leaf_samples_(leaf_samples), blocks_(make_blocks(cfg)) {
  use_workspace(0);
  if (placed.empty()) placed = place_params(cfg, MeshConfig{}, MeshConfig::RankCoords{});
  int64_t off = 0;
  for (ParamInfo& p : placed) {
    if (!held_blocks.empty() &&
        std::find(held_blocks.begin(), held_blocks.end(), block_of(cfg, p.name)) == held_blocks.end())
      continue;  // a pipeline stage holds only its blocks' tensors
    p.offset = off;
    off += p.size;
    infos_.push_back(p);
  }
  w_.resize(off);
  n_weights_ = off;
  g_.assign(off, 0.0f);
  for (const ParamInfo& p : infos_) {
    float* w = w_.data() + p.offset;
    if (!p.decay) {
      std::fill(w, w + p.size, 1.0f);  // norm gains start at one
      continue;
    }
    const uint32_t id = tensor_id(p.name.c_str());
    parallel_for(p.size, [&](int64_t i) { w[i] = init_uniform(seed, id, (uint64_t)p.global_index(i), cfg.init_std); }, 65537);
  }
}

MoeTransformer::MoeTransformer(const MoeTransformer& main, LaneTag)
    : cfg_(main.cfg_), leaf_samples_(main.leaf_samples_), infos_(main.infos_), blocks_(make_blocks(main.cfg_)) {
  use_workspace(0);
  n_weights_ = main.n_weights_;
  g_.assign((size_t)n_weights_, 0.0f);
  wsrc_ = main.weights();
}

std::unique_ptr<MoeTransformer> MoeTransformer::lane_of(const MoeTransformer& main) {
  return std::unique_ptr<MoeTransformer>(new MoeTransformer(main, LaneTag{}));
}

MoeTransformer::~MoeTransformer() = default;

void MoeTransformer::place_storage(float* weights, float* grads) {
  w_at_ = weights;
  g_at_ = grads;
  ops::DeviceVector<float>().swap(w_);
  ops::DeviceVector<float>().swap(g_);
}

// The weights and gradients this model reads and writes (placed: in memory it shares).
int64_t MoeTransformer::storage_bytes() const {
  const int64_t own = (int64_t)(w_.capacity() + g_.capacity());
  return (w_at_ ? 2 * n_weights_ : own) * (int64_t)sizeof(float);
}

void MoeTransformer::use_workspace(int slot) {
  while ((int)workspaces_.size() <= slot) workspaces_.push_back(std::make_unique<StepWorkspace>());
  StepWorkspace* next = workspaces_[(size_t)slot].get();
  if (ws_ && next != ws_) ws_->hand_backward_scratch(*next);
  ws_ = next;
}

int64_t MoeTransformer::workspace_bytes() const {
  int64_t n = 0;
  for (const auto& ws : workspaces_) n += ws->allocated_bytes();
  return n;
}

float MoeTransformer::ce_partial() const { return ws_->ce_partial.empty() ? 0.0f : ws_->ce_partial[0]; }

const std::vector<float>& MoeTransformer::router_partial(int layer) const {
  return ws_->layers.at((size_t)layer).router_partial;
}

const std::vector<int64_t>& MoeTransformer::expert_counts(int layer) const {
  return ws_->layers.at((size_t)layer).global_counts;
}

void MoeTransformer::set_expert_counts(int layer, const std::vector<int64_t>& counts) {
  ws_->layers.at((size_t)layer).global_counts = counts;
}

void MoeTransformer::begin_step() {
  stats_.rounds = 0;
  stats_.borrowed = stats_.dropped = stats_.expert_gemm_calls = stats_.all_to_all_calls = stats_.all_to_all_bytes = 0;
  stats_.cp_attention_seconds = 0;
  stats_.all_to_all_started = stats_.cp_bytes_sent = stats_.cp_kv_bytes_sent = stats_.cp_link_messages = 0;
  stats_.stream_rows = {};
  stats_.tokens_per_expert.assign((size_t)cfg_.n_layers * cfg_.experts, 0);
}

LayerBalance layer_balance(const ModelConfig& cfg, const float* router_sums, const int64_t* counts,
                           float global_tokens, float global_assignments) {
  const int E = cfg.experts;
  const float z = router_sums[E] / global_tokens;
  if (cfg.aux_scope == AuxScope::kSequence) return {router_sums[E + 1] / (global_tokens / (float)cfg.seq_len), z};
  float dot = 0.0f;  // reduces over the expert index e
  for (int e = 0; e < E; ++e) {
    const float f = (float)counts[e] / global_assignments;
    const float share = router_sums[e] / global_tokens;
    dot = ls::fma(f, share, dot);
  }
  return {(float)E * dot, z};
}

float sequence_balance(const float* gates, const int* sel, int64_t samples, int seq_len, int experts, int top_k,
                       int64_t leaf_samples, std::vector<int64_t>& counts) {
  const int E = experts, K = top_k;
  const int64_t T = seq_len;
  counts.assign((size_t)(samples * E), 0);
  std::vector<float> leaf_sums((size_t)(samples / leaf_samples), 0.0f), gate_sums((size_t)E);
  for (int64_t s = 0; s < samples; ++s) {
    int64_t* n = &counts[(size_t)(s * E)];
    for (int64_t i = s * T * K; i < (s + 1) * T * K; ++i) ++n[sel[i]];
    std::fill(gate_sums.begin(), gate_sums.end(), 0.0f);
    for (int64_t t = s * T; t < (s + 1) * T; ++t)  // reduces over the sample's tokens, in order
      for (int e = 0; e < E; ++e) gate_sums[(size_t)e] = gate_sums[(size_t)e] + gates[t * E + e];
    float dot = 0.0f;  // reduces over the expert index e
    for (int e = 0; e < E; ++e) {
      const float f = (float)n[e] / (float)(T * K);
      dot = ls::fma(f, gate_sums[(size_t)e] / (float)T, dot);
    }
    float& leaf = leaf_sums[(size_t)(s / leaf_samples)];  // reduces over the leaf's samples, in order
    leaf = leaf + (float)E * dot;
  }
  return tree_sum(leaf_sums.data(), (int64_t)leaf_sums.size());  // over leaves, the canonical tree
}

float total_loss(const ModelConfig& c, const StepLosses& l) {
  return l.ce + c.aux_loss_weight * l.aux + c.z_loss_weight * l.z;
}

const ParamInfo& MoeTransformer::param(const std::string& name) const {
  for (const ParamInfo& p : infos_)
    if (p.name == name) return p;
  throw std::out_of_range("engine: no parameter '" + name + "'");
}

// Keep in step with LayerActs, StepWorkspace (model/step_context.h) and the
// resize calls of the blocks and experts.cc; the memory test (tests/test_memory.cc) holds the sum to the
// measured peak RSS.
WorkspaceEstimate estimate_workspace(const ModelConfig& c, int batch, int ep_size, int probs_bytes) {
  const int64_t B = batch, S = c.seq_len, D = c.d_model, F = c.d_ff, E = c.experts, V = c.vocab, H = c.n_heads;
  const int64_t N = B * S, NK = N * c.top_k, L = c.n_layers;
  const int64_t f = sizeof(float), i64 = sizeof(int64_t);
  WorkspaceEstimate w;
  // Per layer: x, xm, a, o, a2 and qkv; attention probabilities; r1, r2, lse;
  // router logits and gates; routing indices; the shared expert.
  int64_t layer = (8 * N * D + 3 * N + 2 * N * E) * f + B * H * ops::attention_probs_floats((int)S) * probs_bytes +
                  NK * (sizeof(int) + 2 * i64) + (2 * E + 1) * i64;
  if (c.shared_expert) layer += (4 * N * F + N * D) * f;
  // Whole-model scratch: h, af, dh, dtmp, da2, dO; dqkv; logits, prob, dlogits;
  // rf, lse, loss; dg, dz; dye, dxe; the shared expert's backward.
  int64_t scratch = (9 * N * D + 3 * N * V + 3 * N + 2 * N * E + 2 * NK * D) * f;
  if (c.shared_expert) scratch += (3 * N * F + N * D) * f;
  w.activations = L * layer + scratch;
  w.per_layer = layer;
  w.scratch = scratch;
  // Of it, what only a backward pass reads (StepWorkspace::hand_backward_scratch): dh, dtmp, da2, dO,
  // dqkv, dlogits, dg, dz, dye, dxe and the shared expert's.
  w.backward_scratch = (7 * N * D + N * V + 2 * N * E + 2 * NK * D) * f + (c.shared_expert ? (3 * N * F + N * D) * f : 0);
  // Per layer, what is kept per routed row: outputs (D), u, v and sg (F),
  // the leaf id; with expert parallelism the received input row (D) too.
  const int64_t El = E / ep_size;
  w.expert_buffers = L * (NK * (D + 3 * F) * f + NK * i64);
  if (ep_size > 1) w.expert_buffers += L * NK * D * f;
  // The slots, capacity x local experts rows of x (D) and act, dact, du, dv
  // (F), plus y, dy, dx (D) with expert parallelism; shared by the layers.
  // peak reserves the busiest expert's load, which routing decides:
  // estimated at the mean load here.
  ModelConfig mean = c;
  if (c.moe_policy == MoePolicy::kPeak) mean.capacity_factor = 1.0f, mean.moe_capacity = 0;
  const int64_t slots = round_capacity(mean, N * ep_size) * El;
  w.expert_buffers += slots * ((ep_size > 1 ? 4 : 1) * D + 4 * F) * f;
  // Expert parallel: one round's send and receive buffers, every owner's slots each.
  if (ep_size > 1) w.dispatch_buffers = 2 * ep_size * slots * D * f;
  return w;
}

double train_flops_per_token(const ModelConfig& c) {
  const double D = c.d_model, F = c.d_ff, E = c.experts, K = c.top_k, V = c.vocab, S = c.seq_len;
  double per_layer = 2 * D * 3 * D + 2 * D * D + 2 * D * E   // qkv, out, router
                     + 2 * (S + 1) / 2 * D * 2               // causal scores and values
                     + K * 3 * 2 * D * F                     // routed SwiGLU experts
                     + (c.shared_expert ? 3 * 2 * D * F : 0);
  double fwd = c.n_layers * per_layer + 2 * D * V;
  return 3 * fwd;  // backward is about twice the forward
}

void MoeTransformer::set_moe_stats_from_lanes(const std::vector<const MoeStats*>& lanes) {
  MoeStats st;
  st.tokens_per_expert.assign((size_t)cfg_.n_layers * cfg_.experts, 0);
  for (const MoeStats* lane : lanes) {
    for (size_t i = 0; i < st.tokens_per_expert.size(); ++i) st.tokens_per_expert[i] += lane->tokens_per_expert[i];
    st.rounds = std::max(st.rounds, lane->rounds);
    st.borrowed += lane->borrowed;
    st.dropped += lane->dropped;
    st.expert_gemm_calls += lane->expert_gemm_calls;
    st.all_to_all_calls += lane->all_to_all_calls;
    st.all_to_all_bytes += lane->all_to_all_bytes;
    st.all_to_all_started += lane->all_to_all_started;
    st.peak_expert_bytes = std::max(st.peak_expert_bytes, lane->peak_expert_bytes);
    st.peak_dispatch_bytes = std::max(st.peak_dispatch_bytes, lane->peak_dispatch_bytes);
    st.peak_routed_bytes = std::max(st.peak_routed_bytes, lane->peak_routed_bytes);
    st.peak_grad_state_bytes = std::max(st.peak_grad_state_bytes, lane->peak_grad_state_bytes);
    st.workspace_bytes += lane->workspace_bytes;  // the lanes are one rank's threads: their buffers add up
    st.weight_bytes += lane->weight_bytes;        // a lane's own gradients (it reads these weights)
    for (int op = 0; op < kStreamOps; ++op) st.stream_rows[op] += lane->stream_rows[op];  // the rank's rows, shared
  }
  st.weight_bytes += storage_bytes();
  stats_ = st;
}

StepLosses MoeTransformer::forward(const uint8_t* tokens, int batch) { return run(tokens, batch, false); }
StepLosses MoeTransformer::forward_backward(const uint8_t* tokens, int batch) { return run(tokens, batch, true); }

std::vector<std::string> MoeTransformer::block_names() const {
  std::vector<std::string> names;
  for (const auto& b : blocks_) names.push_back(b->name());
  return names;
}

StepContext MoeTransformer::step_context(const uint8_t* tokens, int batch, bool training) {
  const ModelConfig& c = cfg_;
  const int dp = mesh_->size(Axis::kData), ep = mesh_->size(Axis::kExpert);
  const int tp = mesh_->size(Axis::kTensor), tp_rank = mesh_->rank(Axis::kTensor);
  check_placement();
  if (batch % leaf_samples_ != 0)
    throw std::invalid_argument("engine: batch " + std::to_string(batch) + " is not a multiple of numerics.leaf_samples");
  StepContext ctx{c, *ws_, stats_, infos_, wsrc_ ? wsrc_ : weights(), grads(), tokens};
  ctx.batch = batch;
  ctx.tokens = (int64_t)batch * c.seq_len;
  ctx.leaf_tokens = (int64_t)leaf_samples_ * c.seq_len;
  ctx.leaves = ctx.tokens / ctx.leaf_tokens;
  ctx.mesh = mesh_;
  ctx.local_experts = c.experts / ep;
  ctx.sp = tp > 1 && mesh_->sequence_parallel();
  ctx.stream_tokens = ctx.sp ? ctx.tokens / tp : ctx.tokens;
  ctx.stream_first = ctx.sp ? ctx.stream_tokens * tp_rank : 0;
  ctx.stream_leaves = ctx.sp ? ctx.leaves / tp : ctx.leaves;
  if (ctx.sp && (ctx.leaves % tp != 0))
    throw std::invalid_argument("engine: sequence parallel needs whole leaves per tensor-parallel rank");
  ctx.microbatches = ws_->microbatches;
  ctx.microbatch = ws_->microbatch;
  if (source_grads_.size() < (size_t)c.n_layers) source_grads_.resize((size_t)c.n_layers);
  ctx.source_grads = &source_grads_;
  const int64_t mb = std::max(1, ctx.microbatches);  // a pipeline's microbatches: the step's tokens are mb times these
  ctx.global_tokens = (float)(ctx.tokens * dp * mb);
  ctx.global_assignments = (float)(ctx.tokens * c.top_k * dp * mb);
  ctx.trace = training ? trace_ : nullptr;  // evaluation passes are not traced
  ctx.debug_reorder_moe_norm = debug_reorder_moe_norm_;
  return ctx;
}

// The mesh a step runs on must be the one the tensors were placed on: each
// split's axis makes its parts, and this rank holds its own.
void MoeTransformer::check_placement() const {
  // An axis that does not split a tensor must not be split by the mesh either (the tensor would be whole).
  const bool experts_held = std::any_of(infos_.begin(), infos_.end(), [](const ParamInfo& p) { return p.expert; });
  if (experts_held && mesh_->size(Axis::kExpert) > 1 &&
      !std::any_of(infos_.begin(), infos_.end(), [](const ParamInfo& p) { return p.split_over(Axis::kExpert); }))
    throw InternalError("engine: the mesh splits the experts but the model holds them whole");
  for (const ParamInfo& p : infos_)
    for (const TensorSplit& s : p.splits)
      if (mesh_->size(s.axis) != s.parts || s.first != s.held() * mesh_->rank(s.axis))
        throw InternalError("engine: the mesh disagrees with where tensor " + p.name + " was placed");
}

void MoeTransformer::check_range(int first, int last) const {
  const int n = num_blocks();
  if (first < 0 || last > n || first >= last)
    throw InternalError("engine: block range [" + std::to_string(first) + ", " + std::to_string(last) + ") is not inside [0, " +
                    std::to_string(n) + ")");
  for (int b : {first, last})
    if (b > 0 && b < n && !blocks_[b]->begins_at_stream())
      throw InternalError("engine: a block range cannot begin or end before block " + std::to_string(b) + " (" +
                      blocks_[b]->name() + "): more than the residual stream crosses there");
}

StepLosses MoeTransformer::forward_range(const uint8_t* tokens, int batch, bool training, int first, int last,
                                         const StageIo& io) {
  check_range(first, last);
  ops::synchronize();  // a kernel backend: the last step's kernels are done before the host rewrites inputs
  ws_->microbatches = io.microbatches;
  ws_->microbatch = io.microbatch;
  StepContext ctx = step_context(tokens, batch, training);
  StepWorkspace& ws = *ws_;
  const int64_t N = ctx.stream_tokens, D = cfg_.d_model;  // the stream's tokens held here
  // This step's execution counts (the memory high-water marks persist); a pipeline counts over its microbatches.
  if (io.microbatches == 0) begin_step();
  ws.uniform_off.resize(ctx.leaves + 1);
  for (int64_t l = 0; l <= ctx.leaves; ++l) ws.uniform_off[l] = l * ctx.leaf_tokens;
  if (ws.batch != batch) {
    ws.layers.assign(cfg_.n_layers, LayerActs{});
    ws.batch = batch;
  }
  ws.aux_loss.assign(cfg_.n_layers, 0.0f);
  ws.z_loss.assign(cfg_.n_layers, 0.0f);
  // The residual stream lives in the saved layer inputs: layer l reads x,
  // writes mid (after attention) and the next layer's x (h after the last).
  // Only the layers the range touches (a pipeline stage's), and the stream it hands on.
  const int first_layer = std::max(0, (first - 1) / kBlocksPerLayer);
  const int end_layer = std::min(cfg_.n_layers, (last - 1 + kBlocksPerLayer - 1) / kBlocksPerLayer);
  for (int l = first_layer; l < end_layer; ++l) {
    ws.layers[(size_t)l].x.resize(N * D);
    ws.layers[(size_t)l].mid.resize(N * D);
  }
  if (end_layer < cfg_.n_layers) ws.layers[(size_t)end_layer].x.resize(N * D);
  if (last > layer_block(cfg_.n_layers, LayerPart::kAttention) - 1) ws.h.resize(N * D);  // the range reaches the head
  if (first == 0 && ctx.trace && trace_state_) {
    ops::synchronize();
    for (const ParamInfo& p : infos_) ctx.trace->tensor("params", -1, "param", p.name.c_str(), ctx.weights + p.offset, p.shape);
  }
  if (first > 0) {
    if (!io.stream_in) throw InternalError("engine: forward_range from block " + std::to_string(first) + " needs stream_in");
    std::memcpy(blocks_[first]->stream_in(ws), io.stream_in, sizeof(float) * N * D);
  }
  StepLosses losses = io.carried;
  for (int b = first; b < last; ++b) {
    if (block_hooks_.before_forward) block_hooks_.before_forward(b);
    blocks_[b]->forward(ctx, losses);
  }
  if (ws.exchange_in_flight.pending) throw InternalError("engine: an expert exchange was started and never finished");
  ops::synchronize();
  if (last < num_blocks() && io.stream_out) ops::copy_to_host(io.stream_out, blocks_[last]->stream_in(ws), sizeof(float) * N * D);
  return losses;
}

void MoeTransformer::backward_range(int first, int last, const float* grad_out, float* grad_in) {
  check_range(first, last);
  StepContext ctx = step_context(nullptr, ws_->batch, true);
  const int64_t N = ctx.stream_tokens, D = cfg_.d_model;  // the stream's tokens held here
  if (last < num_blocks()) {
    if (!grad_out) throw InternalError("engine: backward_range to block " + std::to_string(last) + " needs grad_out");
    ops::synchronize();
    ws_->dh.resize(N * D);
    std::memcpy(ws_->dh.data(), grad_out, sizeof(float) * N * D);
  }
  for (int b = last - 1; b >= first; --b) {
    blocks_[b]->backward(ctx);
    if (block_hooks_.after_backward) {
      ops::synchronize();  // a kernel backend: the block's gradients are written before anyone sends them
      block_hooks_.after_backward(b);
    }
  }
  if (ws_->exchange_in_flight.pending) throw InternalError("engine: an expert exchange was started and never finished");
  if (first == 0 && ctx.trace && trace_state_) {
    ops::synchronize();
    for (const ParamInfo& p : infos_) ctx.trace->tensor("grad", -1, "param", p.name.c_str(), grads() + p.offset, p.shape);
  }
  ops::synchronize();  // the gradients are done: the trainer's collectives and optimizer may read them
  stats_.workspace_bytes = workspace_bytes();
  stats_.weight_bytes = storage_bytes();
  if (first > 0 && grad_in) ops::copy_to_host(grad_in, ws_->dh.data(), sizeof(float) * N * D);
}

// A step: every block forward, then (training) every block backward.
StepLosses MoeTransformer::run(const uint8_t* tokens, int batch, bool training) {
  if (training && phase_hook_) phase_hook_(TrainPhase::kForward);
  const StepLosses losses = forward_range(tokens, batch, training, 0, num_blocks(), StageIo{});
  if (!training) return losses;
  if (phase_hook_) phase_hook_(TrainPhase::kBackward);
  backward_range(0, num_blocks(), nullptr, nullptr);
  return losses;
}

std::vector<std::unique_ptr<Block>> make_blocks(const ModelConfig& cfg) {
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.push_back(make_embedding_block());
  for (int l = 0; l < cfg.n_layers; ++l) {
    blocks.push_back(make_attention_block(l));
    blocks.push_back(make_moe_routing_block(l));
    blocks.push_back(make_moe_dispatch_block(l));
    blocks.push_back(make_moe_experts_block(l));
    blocks.push_back(make_moe_combine_block(l));
  }
  blocks.push_back(make_head_block());
  return blocks;
}
}  // namespace ls
