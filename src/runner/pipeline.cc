// Pipeline stages: the cut, the schedules, and a stage's step.
#include "runner/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "common/error.h"
#include "common/numerics_level.h"
#include "contract.h"

namespace ls {

std::vector<PipelineAction> pipeline_order(PipelineSchedule schedule, int stages, int chunks, int microbatches,
                                           int stage) {
  const int p = stages, v = chunks, m = microbatches, s = stage;
  if (schedule != PipelineSchedule::kInterleaved && v != 1)
    throw InternalError("pipeline_order: model chunks per stage need the interleaved schedule (the scenario checks)");
  std::vector<PipelineAction> order;
  if (schedule == PipelineSchedule::kGpipe) {
    for (int mb = 0; mb < m; ++mb) order.push_back({true, mb, 0});
    for (int mb = 0; mb < m; ++mb) order.push_back({false, mb, 0});
    return order;
  }
  // 1F1B and its interleaved form: the k-th forward and the k-th backward
  // of this stage, in microbatch groups of p (interleaved: chunk by chunk
  // inside a group, the backward's chunks in reverse).
  const int total = m * v;
  auto pass = [&](int k, bool forward) {
    if (v == 1) return PipelineAction{forward, k, 0};
    if (m % p != 0)
      throw InternalError("pipeline_order: interleaved needs microbatches a multiple of stages (the scenario checks)");
    const int group = k / (p * v), in_group = k % (p * v), chunk = in_group / p;
    return PipelineAction{forward, group * p + in_group % p, forward ? chunk : v - 1 - chunk};
  };
  int warmup = v == 1 ? std::min(p - s - 1, m) : std::min((p - s - 1) * 2 + (v - 1) * p, total);
  if (v > 1 && m == p) warmup = total;  // one group: every forward first (as Megatron-LM)
  for (int k = 0; k < warmup; ++k) order.push_back(pass(k, true));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(pass(warmup + k, true));
    order.push_back(pass(k, false));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(pass(k, false));
  return order;
}

std::vector<std::pair<int, int>> pipeline_chunks(const ModelConfig& c, int count) {
  // Units [first, last) of blocks and their forward FLOPs per token.
  const double D = c.d_model, F = c.d_ff, S = c.seq_len;
  std::vector<std::pair<int, int>> units = {{0, 1}};
  std::vector<double> cost = {D};
  for (int l = 0; l < c.n_layers; ++l) {
    units.push_back({layer_block(l, LayerPart::kAttention), layer_block(l, LayerPart::kRouting)});
    cost.push_back(2 * D * 3 * D + 2 * D * D + 2 * (S + 1) / 2 * D * 2);
    units.push_back({layer_block(l, LayerPart::kRouting), layer_block(l + 1, LayerPart::kAttention)});
    cost.push_back(2 * D * c.experts + c.top_k * 3 * 2 * D * F + (c.shared_expert ? 3 * 2 * D * F : 0));
  }
  const int head = layer_block(c.n_layers, LayerPart::kAttention);
  units.push_back({head, head + 1});
  cost.push_back(2 * D * c.vocab);
  const int U = (int)units.size();
  if (count < 1 || count > U)
    throw UserError("mesh.pp: " + std::to_string(count) + " pipeline chunks, but the model cuts into at most " +
                    std::to_string(U) + " (the embedding, each layer's attention and MoE, the head)");
  std::vector<double> prefix(U + 1, 0.0);
  for (int u = 0; u < U; ++u) prefix[u + 1] = prefix[u] + cost[u];
  // The cuts that make the costliest chunk cheapest (the pipeline runs at its
  // slowest stage's pace): best[k][u] = that maximum for the first u units in
  // k chunks, from[k][u] the start of the k-th chunk.
  const double inf = 1e300;
  std::vector<std::vector<double>> best(count + 1, std::vector<double>(U + 1, inf));
  std::vector<std::vector<int>> from(count + 1, std::vector<int>(U + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= count; ++k)
    for (int u = k; u <= U; ++u)
      for (int v = k - 1; v < u; ++v) {
        const double worst = std::max(best[k - 1][v], prefix[u] - prefix[v]);
        if (worst < best[k][u]) best[k][u] = worst, from[k][u] = v;
      }
  std::vector<int> cut(count + 1, U);
  for (int k = count; k > 0; --k) cut[k - 1] = from[k][cut[k]];
  std::vector<std::pair<int, int>> out;
  for (int k = 0; k < count; ++k) out.push_back({units[cut[k]].first, units[cut[k + 1] - 1].second});
  return out;
}

int gradient_tree_buffers(int microbatches) {
  int levels = 1;
  while ((1 << levels) <= microbatches) ++levels;
  return levels;
}

double pipeline_bubble_formula(PipelineSchedule schedule, int stages, int chunks, int microbatches) {
  const double p = stages, m = microbatches, v = schedule == PipelineSchedule::kInterleaved ? chunks : 1;
  return (p - 1) / (v * m + p - 1);
}

PipelineStage::PipelineStage(const ModelConfig& cfg, PipelineSchedule schedule, int stages, int chunks_per_stage,
                             int microbatches, int stage)
    : cfg_(cfg),
      schedule_(schedule),
      stages_(stages),
      chunks_per_stage_(chunks_per_stage),
      microbatches_(microbatches),
      stage_(stage),
      chunks_(pipeline_chunks(cfg, stages * chunks_per_stage)) {}

std::vector<int> PipelineStage::held_blocks() const {
  std::vector<int> blocks;
  for (int k = 0; k < chunks_per_stage_; ++k)
    for (int b = chunks_[model_chunk(k)].first; b < chunks_[model_chunk(k)].second; ++b) blocks.push_back(b);
  return blocks;
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The layers whose MoE statistics blocks [first, last) produce (it runs their moe_combine).
std::vector<int> layers_combined_in(const ModelConfig& c, int first, int last) {
  std::vector<int> layers;
  for (int l = 0; l < c.n_layers; ++l)
    if (layer_block(l, LayerPart::kCombine) >= first && layer_block(l, LayerPart::kCombine) < last) layers.push_back(l);
  return layers;
}

// The mesh sizes a stage's passes depend on, read from the mesh once per
// step or evaluation: the one place this file asks for them.
struct MeshSizes {
  int tp = 1, dp = 1, ep = 1;
  bool sp = false;  // sequence parallel, over a tensor-parallel group of more than one rank
};

MeshSizes mesh_sizes(const Mesh& mesh) {
  MeshSizes s;
  s.tp = mesh.size(Axis::kTensor);
  s.dp = mesh.size(Axis::kData);
  s.ep = mesh.size(Axis::kExpert);
  s.sp = mesh.sequence_parallel();
  return s;
}

// The bytes of the residual stream (or its gradient) a stage passes on for
// `tokens` tokens: sequence parallel, this tensor-parallel rank's share.
size_t stream_bytes_of(const MeshSizes& mesh, int64_t tokens, int d_model) {
  return (size_t)(mesh.sp ? tokens / mesh.tp : tokens) * d_model * sizeof(float);
}

}  // namespace

// One training step of this stage, built per step: its chunks, the passes of
// the schedule over the step's microbatches, and the partial sums they leave
// (the router statistics and the cross-entropy per microbatch, the
// gradients' trees over microbatches) until the step combines them.
struct PipelineStage::Step {
  Step(PipelineStage& stage, MoeTransformer& model, const Mesh& mesh, Communicator& pipe, const uint8_t* tokens,
       int samples);
  // Every pass of the schedule (phase: as train()'s).
  void run(const std::function<void(TrainPhase)>& phase);
  // The rank's gradients: each chunk's tree over microbatches, back in place.
  void finish_gradients();
  // The step's losses, on every stage (a collective over the pipeline).
  StepLosses losses() const;

  double busy = 0;  // seconds inside passes and the gradient trees

 private:
  // A chunk of this stage during the step.
  struct Chunk {
    int model_chunk = 0, first = 0, last = 0;
    std::vector<int> layers;          // whose router statistics it produces
    std::vector<size_t> params;       // the model's tensors it writes gradients of
    int64_t width = 0;                // their elements
    float* tree_scratch = nullptr;    // the gradient tree over microbatches (LeafTree levels; the stage's)
    int forwards = 0;                 // microbatches that ran its forward
    int backwards = 0;                // and its backward
    bool combined = false;            // its statistics are the step's
  };
  Chunk make_chunk(int k) const;  // the stage's chunk k
  void forward(const PipelineAction& a);
  void backward(const PipelineAction& a);
  void keep_statistics(const Chunk& ch, int mb);  // what microbatch mb's forward left
  void combine(Chunk& ch);                        // its statistics over every microbatch and rank
  void push_gradient_leaf(size_t k);              // the last backward's gradients, into chunk k's tree
  void claim_workspace(int mb);                   // before mb's first forward here
  void release_workspace(int mb);                 // after mb's last backward here

  PipelineStage& stage_;
  const ModelConfig& cfg_;
  MoeTransformer& model_;
  const Mesh& mesh_;  // this rank's groups
  Communicator& pipe_;
  const uint8_t* tokens_;
  const std::vector<ParamInfo>& infos_;
  const MeshSizes sizes_;
  // Microbatches, chunks per stage, model chunks in the pipeline, layers, experts.
  const int m_, v_, C_, L_, E_;
  const int mb_samples_;
  const int64_t sample_bytes_, mb_tokens_;
  const size_t stream_bytes_;
  const float global_tokens_, global_assignments_;
  // The backward reads the step's expert counts only through the aux loss's gradient, which is +0 at weight 0,
  // and with moe.aux_scope=sequence reads its own microbatch's samples' counts instead.
  const bool hold_;
  const size_t router_width_;  // a microbatch's router sums: E gate sums, lse^2 (and the samples' losses)

  std::vector<Chunk> chunks_;
  std::vector<LeafTree> trees_;  // per chunk
  // Per layer, every microbatch's router sums and counts; the cross-entropy sums.
  std::vector<std::vector<float>> router_;
  std::vector<std::vector<int64_t>> counts_, step_counts_;
  std::vector<LayerBalance> balance_;
  std::vector<float> ce_parts_;
  float ce_sum_ = 0.0f;
  // Workspaces: one per microbatch in flight, reused once its last backward here is done.
  std::vector<int> slot_of_, backwards_left_, free_slots_;
  int slots_ = 0, in_flight_ = 0;
  std::vector<float> stream_in_, stream_out_, grad_out_, grad_in_;
};

PipelineStage::Step::Step(PipelineStage& stage, MoeTransformer& model, const Mesh& mesh, Communicator& pipe,
                          const uint8_t* tokens, int samples)
    : stage_(stage),
      cfg_(stage.cfg_),
      model_(model),
      mesh_(mesh),
      pipe_(pipe),
      tokens_(tokens),
      infos_(model.params()),
      sizes_(mesh_sizes(mesh)),
      m_(stage.microbatches_),
      v_(stage.chunks_per_stage_),
      C_(stage.stages_ * v_),
      L_(cfg_.n_layers),
      E_(cfg_.experts),
      mb_samples_(samples / m_),
      sample_bytes_(cfg_.seq_len + 1),
      mb_tokens_((int64_t)mb_samples_ * cfg_.seq_len),
      stream_bytes_(stream_bytes_of(sizes_, mb_tokens_, cfg_.d_model)),
      global_tokens_((float)(mb_tokens_ * sizes_.dp * m_)),
      global_assignments_((float)(mb_tokens_ * cfg_.top_k * sizes_.dp * m_)),
      hold_(cfg_.aux_loss_weight != 0.0f && cfg_.aux_scope == AuxScope::kBatch),
      router_width_((size_t)E_ + (cfg_.aux_scope == AuxScope::kSequence ? 2 : 1)),
      router_((size_t)L_),
      counts_((size_t)L_),
      step_counts_((size_t)L_),
      balance_((size_t)L_),
      ce_parts_((size_t)m_, 0.0f),
      slot_of_((size_t)m_, -1),
      backwards_left_((size_t)m_, v_) {
  for (int k = 0; k < v_; ++k) chunks_.push_back(make_chunk(k));
  for (Chunk& ch : chunks_) trees_.emplace_back(ch.tree_scratch, ch.width);
  for (const Chunk& ch : chunks_)
    for (int l : ch.layers) {
      router_[(size_t)l].assign((size_t)m_ * router_width_, 0.0f);
      counts_[(size_t)l].assign((size_t)m_ * E_, 0);
    }
}

PipelineStage::Step::Chunk PipelineStage::Step::make_chunk(int k) const {
  Chunk ch;
  ch.model_chunk = stage_.model_chunk(k);
  std::tie(ch.first, ch.last) = stage_.chunks_[ch.model_chunk];
  ch.layers = layers_combined_in(cfg_, ch.first, ch.last);
  for (size_t t = 0; t < infos_.size(); ++t) {
    const int b = MoeTransformer::block_of(cfg_, infos_[t].name);
    // Expert slices (over mesh.ep, or over a token group's data ranks): the model keeps their trees per source
    // rank over the microbatches itself (StepContext::grads_by_source).
    if (infos_[t].split_over(Axis::kExpert) || (infos_[t].expert && mesh_.size(Axis::kExpertTokens) > 1)) continue;
    if (b >= ch.first && b < ch.last) ch.params.push_back(t), ch.width += infos_[t].size;
  }
  if (m_ > 1) {
    std::vector<std::vector<float>>& kept = stage_.tree_scratch_;
    if (kept.size() < (size_t)v_) kept.resize((size_t)v_);
    std::vector<float>& tree = kept[(size_t)k];
    tree.resize((size_t)gradient_tree_buffers(m_) * ch.width);
    ch.tree_scratch = tree.data();
  }
  return ch;
}

void PipelineStage::Step::run(const std::function<void(TrainPhase)>& phase) {
  // The schedule's order, except that with hold_ a chunk's backward waits
  // (running the next forwards instead) until its counts are the step's.
  const std::vector<PipelineAction> order = pipeline_order(stage_.schedule_, stage_.stages_, v_, m_, stage_.stage_);
  std::vector<bool> done(order.size(), false);
  bool entered[2] = {false, false};  // forward, backward
  size_t next = 0;
  for (size_t ran = 0; ran < order.size(); ++ran) {
    while (done[next]) ++next;
    size_t i = next;
    if (!order[i].forward && hold_ && !chunks_[(size_t)order[i].chunk].combined) {
      stage_.stats_.held = true;
      while (done[i] || !order[i].forward) ++i;
    }
    if (phase && !entered[order[i].forward ? 0 : 1]) {
      entered[order[i].forward ? 0 : 1] = true;
      phase(order[i].forward ? TrainPhase::kForward : TrainPhase::kBackward);
    }
    if (order[i].forward) forward(order[i]);
    else backward(order[i]);
    done[i] = true;
  }
}

void PipelineStage::Step::claim_workspace(int mb) {
  if (slot_of_[(size_t)mb] >= 0) return;
  if (free_slots_.empty()) free_slots_.push_back(slots_++);
  slot_of_[(size_t)mb] = free_slots_.back();
  free_slots_.pop_back();
  stage_.stats_.peak_in_flight = std::max(stage_.stats_.peak_in_flight, ++in_flight_);
}

void PipelineStage::Step::release_workspace(int mb) {
  if (--backwards_left_[(size_t)mb] == 0) {
    free_slots_.push_back(slot_of_[(size_t)mb]);
    --in_flight_;
  }
}

void PipelineStage::Step::forward(const PipelineAction& a) {
  Chunk& ch = chunks_[(size_t)a.chunk];
  const int mb = a.microbatch;
  claim_workspace(mb);
  const bool from_stage = ch.model_chunk > 0, to_stage = ch.model_chunk < C_ - 1;
  if (from_stage) {
    stream_in_.resize(stream_bytes_ / sizeof(float));
    pipe_.recv(stream_in_.data(), stream_bytes_, stage_.stage_of(ch.model_chunk - 1));
  }
  if (to_stage) stream_out_.resize(stream_bytes_ / sizeof(float));
  const Clock::time_point busy0 = Clock::now();
  model_.use_workspace(slot_of_[(size_t)mb]);
  StageIo io;
  io.stream_in = from_stage ? stream_in_.data() : nullptr;
  io.stream_out = to_stage ? stream_out_.data() : nullptr;
  io.microbatches = m_;
  io.microbatch = mb;
  model_.forward_range(tokens_ + (int64_t)mb * mb_samples_ * sample_bytes_, mb_samples_, true, ch.first, ch.last, io);
  keep_statistics(ch, mb);
  busy += seconds_since(busy0);
  if (to_stage) {
    pipe_.send(stream_out_.data(), stream_bytes_, stage_.stage_of(ch.model_chunk + 1));
    stage_.stats_.bytes_sent += (int64_t)stream_bytes_;
  }
  if (++ch.forwards == m_) combine(ch);
}

void PipelineStage::Step::keep_statistics(const Chunk& ch, int mb) {
  for (int l : ch.layers) {
    const std::vector<float>& r = model_.router_partial(l);
    float* mine = router_[(size_t)l].data() + (size_t)mb * router_width_;
    std::copy(r.begin(), r.end(), mine);
    if (sizes_.sp) mesh_.group(Axis::kTensor).all_reduce_sum(mine, router_width_);
    const std::vector<int64_t>& n = model_.expert_counts(l);
    std::copy(n.begin(), n.end(), counts_[(size_t)l].begin() + (size_t)mb * E_);
  }
  if (ch.last == model_.num_blocks()) {
    ce_parts_[(size_t)mb] = model_.ce_partial();
    if (sizes_.sp) mesh_.group(Axis::kTensor).all_reduce_sum(&ce_parts_[(size_t)mb], 1);
  }
}

// The canonical tree over microbatches, then over data-parallel ranks
// (sequence parallel: each microbatch's sums were taken over its TP group first).
void PipelineStage::Step::combine(Chunk& ch) {
  for (int l : ch.layers) {
    std::vector<const float*> parts;
    for (int mb = 0; mb < m_; ++mb) parts.push_back(router_[(size_t)l].data() + (size_t)mb * router_width_);
    std::vector<float> sums(router_width_);
    tree_over_ranks(parts.data(), m_, 0, sums.size(), sums.data());
    mesh_.group(Axis::kData).all_reduce_sum(sums.data(), sums.size());
    std::vector<int64_t>& total = step_counts_[(size_t)l];
    total.assign((size_t)E_, 0);
    for (int mb = 0; mb < m_; ++mb)
      for (int e = 0; e < E_; ++e) total[(size_t)e] += counts_[(size_t)l][(size_t)mb * E_ + e];
    mesh_.group(Axis::kData).all_reduce_sum(total.data(), total.size());
    balance_[(size_t)l] = layer_balance(cfg_, sums.data(), total.data(), global_tokens_, global_assignments_);
  }
  if (ch.last == model_.num_blocks()) {
    std::vector<const float*> parts;
    for (int mb = 0; mb < m_; ++mb) parts.push_back(&ce_parts_[(size_t)mb]);
    tree_over_ranks(parts.data(), m_, 0, 1, &ce_sum_);
    mesh_.group(Axis::kData).all_reduce_sum(&ce_sum_, 1);
  }
  ch.combined = true;
}

void PipelineStage::Step::backward(const PipelineAction& a) {
  const size_t k = (size_t)a.chunk;
  const Chunk& ch = chunks_[k];
  const int mb = a.microbatch;
  const bool from_stage = ch.model_chunk < C_ - 1, to_stage = ch.model_chunk > 0;
  if (from_stage) {
    grad_out_.resize(stream_bytes_ / sizeof(float));
    pipe_.recv(grad_out_.data(), stream_bytes_, stage_.stage_of(ch.model_chunk + 1));
  }
  if (to_stage) grad_in_.resize(stream_bytes_ / sizeof(float));
  const Clock::time_point busy0 = Clock::now();
  model_.use_workspace(slot_of_[(size_t)mb]);
  if (hold_)
    for (int l : ch.layers) model_.set_expert_counts(l, step_counts_[(size_t)l]);
  model_.backward_range(ch.first, ch.last, from_stage ? grad_out_.data() : nullptr,
                        to_stage ? grad_in_.data() : nullptr);
  // Sequence parallel: the tensors the stream's tokens reduce into hold this TP rank's tokens' partial;
  // the tree over TP ranks comes before the tree over microbatches.
  if (sizes_.sp)
    for (size_t t : ch.params)
      if (infos_[t].sums_stream_tokens())
        mesh_.group(Axis::kTensor).all_reduce_sum(model_.grads() + infos_[t].offset, (size_t)infos_[t].size);
  if (m_ > 1) push_gradient_leaf(k);
  busy += seconds_since(busy0);
  if (to_stage) {
    pipe_.send(grad_in_.data(), stream_bytes_, stage_.stage_of(ch.model_chunk - 1));
    stage_.stats_.bytes_sent += (int64_t)stream_bytes_;
  }
  release_workspace(mb);
}

// This microbatch's gradients: the next leaf of the tree over microbatches.
// numerics.level=local: added to a running sum in arrival order instead, as
// a trainer accumulating gradients over microbatches usually does.
void PipelineStage::Step::push_gradient_leaf(size_t k) {
  Chunk& ch = chunks_[k];
  if (local_numerics()) {
    float* sum = ch.tree_scratch;
    for (size_t t : ch.params) {
      const ParamInfo& p = infos_[t];
      const float* g = model_.grads() + p.offset;
      if (ch.backwards == 0) std::memcpy(sum, g, sizeof(float) * p.size);
      else
        for (int64_t i = 0; i < p.size; ++i) sum[i] += g[i];
      sum += p.size;
    }
    ++ch.backwards;
    return;
  }
  float* leaf = trees_[k].next_leaf();
  for (size_t t : chunks_[k].params) {
    const ParamInfo& p = infos_[t];
    std::memcpy(leaf, model_.grads() + p.offset, sizeof(float) * p.size);
    leaf += p.size;
  }
  trees_[k].push();
}

void PipelineStage::Step::finish_gradients() {
  if (m_ == 1) return;  // the one microbatch's gradients are in place
  const Clock::time_point busy0 = Clock::now();
  for (size_t k = 0; k < chunks_.size(); ++k) {
    const float* whole = local_numerics() ? chunks_[k].tree_scratch : trees_[k].finish();
    for (size_t t : chunks_[k].params) {
      const ParamInfo& p = infos_[t];
      std::memcpy(model_.grads() + p.offset, whole, sizeof(float) * p.size);
      whole += p.size;
    }
  }
  busy += seconds_since(busy0);
}

// Each layer's from the stage that ran its combine, the cross-entropy from
// the last; folded in layer order.
StepLosses PipelineStage::Step::losses() const {
  const int stages = stage_.stages_;
  std::vector<float> mine((size_t)2 * L_ + 1, 0.0f), all(mine.size() * stages);
  std::vector<int> owner((size_t)L_ + 1, 0);
  for (int c = 0; c < C_; ++c) {
    for (int l : layers_combined_in(cfg_, stage_.chunks_[c].first, stage_.chunks_[c].second))
      owner[(size_t)l] = stage_.stage_of(c);
  }
  owner[(size_t)L_] = stage_.stage_of(C_ - 1);
  for (int l = 0; l < L_; ++l)
    if (owner[(size_t)l] == stage_.stage_)
      mine[(size_t)2 * l] = balance_[(size_t)l].aux, mine[(size_t)2 * l + 1] = balance_[(size_t)l].z;
  if (owner[(size_t)L_] == stage_.stage_) mine[(size_t)2 * L_] = ce_sum_;
  pipe_.all_gather(mine.data(), all.data(), std::vector<size_t>(stages, mine.size() * sizeof(float)));
  StepLosses out;
  for (int l = 0; l < L_; ++l) {
    const float* from = &all[(size_t)owner[(size_t)l] * mine.size()];
    out.aux = out.aux + from[2 * l];
    out.z = out.z + from[2 * l + 1];
  }
  out.ce = all[(size_t)owner[(size_t)L_] * mine.size() + 2 * L_] / global_tokens_;
  out.total = total_loss(cfg_, out);
  return out;
}

StepLosses PipelineStage::train(MoeTransformer& model, const Mesh& mesh, Communicator& pipe, const uint8_t* tokens,
                                int samples, const std::function<void(TrainPhase)>& phase) {
  stats_ = PipelineStats{};
  const Clock::time_point t0 = Clock::now();
  model.begin_step();
  Step step(*this, model, mesh, pipe, tokens, samples);
  step.run(phase);
  step.finish_gradients();
  const StepLosses losses = step.losses();
  // The means after a warm-up step.
  const double step_time = seconds_since(t0);
  if (++steps_run_ == 1) {
    stats_.busy_seconds = step.busy;
    stats_.step_seconds = step_time;
  } else {
    busy_sum_ += step.busy;
    step_sum_ += step_time;
    stats_.busy_seconds = busy_sum_ / (steps_run_ - 1);
    stats_.step_seconds = step_sum_ / (steps_run_ - 1);
  }
  return losses;
}

float PipelineStage::evaluate(MoeTransformer& model, const Mesh& mesh, Communicator& pipe, const uint8_t* tokens,
                              int samples) {
  tree_scratch_.clear();  // its pages back before the evaluation's activations take theirs
  tree_scratch_.shrink_to_fit();
  const int C = stages_ * chunks_per_stage_;
  const int64_t n_tokens = (int64_t)samples * cfg_.seq_len;
  const MeshSizes sizes = mesh_sizes(mesh);
  const size_t stream_bytes = stream_bytes_of(sizes, n_tokens, cfg_.d_model);
  std::vector<float> stream_in(stream_bytes / sizeof(float)), stream_out(stream_in.size());
  float ce = 0.0f;
  model.use_workspace(0);
  for (int k = 0; k < chunks_per_stage_; ++k) {
    const int c = model_chunk(k);
    if (c > 0) pipe.recv(stream_in.data(), stream_bytes, stage_of(c - 1));
    StageIo io;
    io.stream_in = c > 0 ? stream_in.data() : nullptr;
    io.stream_out = c < C - 1 ? stream_out.data() : nullptr;
    io.microbatches = 1;
    model.forward_range(tokens, samples, false, chunks_[c].first, chunks_[c].second, io);
    if (c < C - 1) pipe.send(stream_out.data(), stream_bytes, stage_of(c + 1));
    if (c == C - 1) {
      ce = model.ce_partial();
      mesh.stream_group().all_reduce_sum(&ce, 1);
      ce = ce / (float)(n_tokens * sizes.dp);
    }
  }
  pipe.broadcast(&ce, sizeof ce, stage_of(C - 1));
  return ce;
}

}  // namespace ls
