// Pipeline stages: the cut, the schedules, and a stage's step.
#include "runner/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "common/error.h"
#include "contract.h"

namespace ls {

std::vector<PipelineAction> pipeline_order(PipelineSchedule schedule, int stages, int chunks, int microbatches,
                                           int stage) {
  const int p = stages, v = chunks, m = microbatches, s = stage;
  if (schedule != PipelineSchedule::kInterleaved && v != 1)
    throw std::logic_error("pipeline_order: model chunks per stage need the interleaved schedule");
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
    if (m % p != 0) throw std::logic_error("pipeline_order: interleaved needs microbatches a multiple of stages");
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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The layers whose MoE statistics blocks [first, last) produce (it runs their moe_combine).
std::vector<int> layers_combined_in(const ModelConfig& c, int first, int last) {
  std::vector<int> layers;
  for (int l = 0; l < c.n_layers; ++l)
    if (layer_block(l, LayerPart::kCombine) >= first && layer_block(l, LayerPart::kCombine) < last) layers.push_back(l);
  return layers;
}

}  // namespace

// A chunk of this stage during one step.
struct PipelineStage::Step {
  struct Chunk {
    int model_chunk = 0, first = 0, last = 0;
    std::vector<int> layers;          // whose router statistics it produces
    std::vector<size_t> params;       // the model's tensors it writes gradients of
    int64_t width = 0;                // their elements
    std::vector<float> tree_scratch;  // the gradient tree over microbatches (LeafTree levels)
    int forwards = 0;                 // microbatches that ran its forward
    bool combined = false;            // its statistics are the step's
  };
  std::vector<Chunk> chunks;
};

StepLosses PipelineStage::train(MoeTransformer& model, const Mesh& mesh, Communicator& pipe, const uint8_t* tokens,
                                int samples, const std::function<void(const char*)>& phase) {
  using clock = std::chrono::steady_clock;
  const int m = microbatches_, v = chunks_per_stage_, C = stages_ * v, L = cfg_.n_layers, E = cfg_.experts;
  const int mb_samples = samples / m;
  const int64_t sample_bytes = cfg_.seq_len + 1, mb_tokens = (int64_t)mb_samples * cfg_.seq_len;
  const bool sp = mesh.sequence_parallel();
  const size_t stream_bytes = (size_t)(sp ? mb_tokens / mesh.size(Axis::kTensor) : mb_tokens) * cfg_.d_model * sizeof(float);
  const float global_tokens = (float)(mb_tokens * mesh.size(Axis::kData) * m);
  const float global_assignments = (float)(mb_tokens * cfg_.top_k * mesh.size(Axis::kData) * m);
  // The backward reads the step's expert counts only through the aux loss's gradient, which is +0 at weight 0.
  const bool hold = cfg_.aux_loss_weight != 0.0f;
  stats_ = PipelineStats{};
  double busy = 0;  // this step's
  const clock::time_point t0 = clock::now();
  model.begin_step();

  Step step;
  const auto& infos = model.params();
  for (int k = 0; k < v; ++k) {
    Step::Chunk ch;
    ch.model_chunk = model_chunk(k);
    std::tie(ch.first, ch.last) = chunks_[ch.model_chunk];
    ch.layers = layers_combined_in(cfg_, ch.first, ch.last);
    for (size_t t = 0; t < infos.size(); ++t) {
      const int b = MoeTransformer::block_of(cfg_, infos[t].name);
      // Expert-parallel slices: the model keeps their trees per source rank over the microbatches itself.
      if (infos[t].expert && mesh.size(Axis::kExpert) > 1) continue;
      if (b >= ch.first && b < ch.last) ch.params.push_back(t), ch.width += infos[t].size;
    }
    if (m > 1) ch.tree_scratch.resize((size_t)LeafTree::levels_for(m) * ch.width);
    step.chunks.push_back(std::move(ch));
  }
  std::vector<LeafTree> trees;
  for (Step::Chunk& ch : step.chunks) trees.emplace_back(ch.tree_scratch.data(), ch.width);

  // Per layer, every microbatch's router sums and counts; the cross-entropy sums.
  std::vector<std::vector<float>> router((size_t)L);
  std::vector<std::vector<int64_t>> counts((size_t)L), step_counts((size_t)L);
  std::vector<LayerBalance> balance((size_t)L);
  std::vector<float> ce_parts((size_t)m, 0.0f);
  float ce_sum = 0.0f;
  for (const Step::Chunk& ch : step.chunks)
    for (int l : ch.layers) {
      router[(size_t)l].assign((size_t)m * (E + 1), 0.0f);
      counts[(size_t)l].assign((size_t)m * E, 0);
    }

  // The canonical tree over microbatches, then over data-parallel ranks
  // (sequence parallel: each microbatch's sums were taken over its TP group first).
  auto combine = [&](Step::Chunk& ch) {
    for (int l : ch.layers) {
      std::vector<const float*> parts;
      for (int mb = 0; mb < m; ++mb) parts.push_back(router[(size_t)l].data() + (size_t)mb * (E + 1));
      std::vector<float> sums((size_t)E + 1);
      tree_over_ranks(parts.data(), m, 0, sums.size(), sums.data());
      mesh.group(Axis::kData).all_reduce_sum(sums.data(), sums.size());
      std::vector<int64_t>& total = step_counts[(size_t)l];
      total.assign((size_t)E, 0);
      for (int mb = 0; mb < m; ++mb)
        for (int e = 0; e < E; ++e) total[(size_t)e] += counts[(size_t)l][(size_t)mb * E + e];
      mesh.group(Axis::kData).all_reduce_sum(total.data(), total.size());
      balance[(size_t)l] = layer_balance(E, sums.data(), total.data(), global_tokens, global_assignments);
    }
    if (ch.last == model.num_blocks()) {
      std::vector<const float*> parts;
      for (int mb = 0; mb < m; ++mb) parts.push_back(&ce_parts[(size_t)mb]);
      tree_over_ranks(parts.data(), m, 0, 1, &ce_sum);
      mesh.group(Axis::kData).all_reduce_sum(&ce_sum, 1);
    }
    ch.combined = true;
  };

  // Workspaces: one per microbatch in flight, reused once its last backward here is done.
  std::vector<int> slot_of((size_t)m, -1), backwards_left((size_t)m, v), free_slots;
  int slots = 0, in_flight = 0;
  std::vector<float> stream_in, stream_out, grad_out, grad_in;

  auto run_forward = [&](const PipelineAction& a) {
    Step::Chunk& ch = step.chunks[(size_t)a.chunk];
    const int mb = a.microbatch;
    if (slot_of[(size_t)mb] < 0) {
      if (free_slots.empty()) free_slots.push_back(slots++);
      slot_of[(size_t)mb] = free_slots.back();
      free_slots.pop_back();
      stats_.peak_in_flight = std::max(stats_.peak_in_flight, ++in_flight);
    }
    const bool from_stage = ch.model_chunk > 0, to_stage = ch.model_chunk < C - 1;
    if (from_stage) {
      stream_in.resize(stream_bytes / sizeof(float));
      pipe.recv(stream_in.data(), stream_bytes, stage_of(ch.model_chunk - 1));
    }
    if (to_stage) stream_out.resize(stream_bytes / sizeof(float));
    const clock::time_point busy0 = clock::now();
    model.use_workspace(slot_of[(size_t)mb]);
    StageIo io;
    io.stream_in = from_stage ? stream_in.data() : nullptr;
    io.stream_out = to_stage ? stream_out.data() : nullptr;
    io.microbatches = m;
    io.microbatch = mb;
    model.forward_range(tokens + (int64_t)mb * mb_samples * sample_bytes, mb_samples, true, ch.first, ch.last, io);
    for (int l : ch.layers) {
      const std::vector<float>& r = model.router_partial(l);
      float* mine = router[(size_t)l].data() + (size_t)mb * (E + 1);
      std::copy(r.begin(), r.end(), mine);
      if (sp) mesh.group(Axis::kTensor).all_reduce_sum(mine, (size_t)E + 1);
      const std::vector<int64_t>& n = model.expert_counts(l);
      std::copy(n.begin(), n.end(), counts[(size_t)l].begin() + (size_t)mb * E);
    }
    if (ch.last == model.num_blocks()) {
      ce_parts[(size_t)mb] = model.ce_partial();
      if (sp) mesh.group(Axis::kTensor).all_reduce_sum(&ce_parts[(size_t)mb], 1);
    }
    busy += seconds_since(busy0);
    if (to_stage) {
      pipe.send(stream_out.data(), stream_bytes, stage_of(ch.model_chunk + 1));
      stats_.bytes_sent += (int64_t)stream_bytes;
    }
    if (++ch.forwards == m) combine(ch);
  };

  auto run_backward = [&](const PipelineAction& a) {
    const size_t k = (size_t)a.chunk;
    Step::Chunk& ch = step.chunks[k];
    const int mb = a.microbatch;
    const bool from_stage = ch.model_chunk < C - 1, to_stage = ch.model_chunk > 0;
    if (from_stage) {
      grad_out.resize(stream_bytes / sizeof(float));
      pipe.recv(grad_out.data(), stream_bytes, stage_of(ch.model_chunk + 1));
    }
    if (to_stage) grad_in.resize(stream_bytes / sizeof(float));
    const clock::time_point busy0 = clock::now();
    model.use_workspace(slot_of[(size_t)mb]);
    if (hold)
      for (int l : ch.layers) model.set_expert_counts(l, step_counts[(size_t)l]);
    model.backward_range(ch.first, ch.last, from_stage ? grad_out.data() : nullptr, to_stage ? grad_in.data() : nullptr);
    // Sequence parallel: the tensors the stream's tokens reduce into hold this TP rank's tokens' partial;
    // the tree over TP ranks comes before the tree over microbatches.
    if (sp)
      for (size_t t : ch.params)
        if (infos[t].tp_mid == 0) mesh.group(Axis::kTensor).all_reduce_sum(model.grads() + infos[t].offset, (size_t)infos[t].size);
    if (m > 1) {  // this microbatch's gradients: the next leaf of the tree over microbatches
      float* leaf = trees[k].next_leaf();
      for (size_t t : ch.params) {
        const ParamInfo& p = infos[t];
        std::memcpy(leaf, model.grads() + p.offset, sizeof(float) * p.size);
        leaf += p.size;
      }
      trees[k].push();
    }
    busy += seconds_since(busy0);
    if (to_stage) {
      pipe.send(grad_in.data(), stream_bytes, stage_of(ch.model_chunk - 1));
      stats_.bytes_sent += (int64_t)stream_bytes;
    }
    if (--backwards_left[(size_t)mb] == 0) {
      free_slots.push_back(slot_of[(size_t)mb]);
      --in_flight;
    }
  };

  // The schedule's order, except that with `hold` a chunk's backward waits
  // (running the next forwards instead) until its counts are the step's.
  const std::vector<PipelineAction> order = pipeline_order(schedule_, stages_, v, m, stage_);
  std::vector<bool> done(order.size(), false);
  bool entered[2] = {false, false};  // forward, backward
  size_t next = 0;
  for (size_t ran = 0; ran < order.size(); ++ran) {
    while (done[next]) ++next;
    size_t i = next;
    if (!order[i].forward && hold && !step.chunks[(size_t)order[i].chunk].combined) {
      stats_.held = true;
      while (done[i] || !order[i].forward) ++i;
    }
    if (phase && !entered[order[i].forward ? 0 : 1]) {
      entered[order[i].forward ? 0 : 1] = true;
      phase(order[i].forward ? "forward" : "backward");
    }
    if (order[i].forward) run_forward(order[i]);
    else run_backward(order[i]);
    done[i] = true;
  }
  if (m > 1) {  // the rank's gradients: the tree over microbatches, back in place
    const clock::time_point busy0 = clock::now();
    for (size_t k = 0; k < step.chunks.size(); ++k) {
      const float* whole = trees[k].finish();
      for (size_t t : step.chunks[k].params) {
        const ParamInfo& p = infos[t];
        std::memcpy(model.grads() + p.offset, whole, sizeof(float) * p.size);
        whole += p.size;
      }
    }
    busy += seconds_since(busy0);
  }

  // The step's losses, on every stage: each layer's from the stage that ran
  // its combine, the cross-entropy from the last; folded in layer order.
  std::vector<float> mine((size_t)2 * L + 1, 0.0f), all(mine.size() * stages_);
  std::vector<int> owner((size_t)L + 1, 0);
  for (int c = 0; c < C; ++c) {
    for (int l : layers_combined_in(cfg_, chunks_[c].first, chunks_[c].second)) owner[(size_t)l] = stage_of(c);
  }
  owner[(size_t)L] = stage_of(C - 1);
  for (int l = 0; l < L; ++l)
    if (owner[(size_t)l] == stage_) mine[(size_t)2 * l] = balance[(size_t)l].aux, mine[(size_t)2 * l + 1] = balance[(size_t)l].z;
  if (owner[(size_t)L] == stage_) mine[(size_t)2 * L] = ce_sum;
  pipe.all_gather(mine.data(), all.data(), std::vector<size_t>(stages_, mine.size() * sizeof(float)));
  StepLosses losses;
  for (int l = 0; l < L; ++l) {
    const float* from = &all[(size_t)owner[(size_t)l] * mine.size()];
    losses.aux = losses.aux + from[2 * l];
    losses.z = losses.z + from[2 * l + 1];
  }
  losses.ce = all[(size_t)owner[(size_t)L] * mine.size() + 2 * L] / global_tokens;
  losses.total = total_loss(cfg_, losses);
  // The means after a warm-up step.
  const double step_time = seconds_since(t0);
  if (++steps_run_ == 1) {
    stats_.busy_seconds = busy;
    stats_.step_seconds = step_time;
  } else {
    busy_sum_ += busy;
    step_sum_ += step_time;
    stats_.busy_seconds = busy_sum_ / (steps_run_ - 1);
    stats_.step_seconds = step_sum_ / (steps_run_ - 1);
  }
  return losses;
}

float PipelineStage::evaluate(MoeTransformer& model, const Mesh& mesh, Communicator& pipe, const uint8_t* tokens,
                              int samples) {
  const int C = stages_ * chunks_per_stage_;
  const int64_t n_tokens = (int64_t)samples * cfg_.seq_len;
  const bool sp = mesh.sequence_parallel();
  const size_t stream_bytes = (size_t)(sp ? n_tokens / mesh.size(Axis::kTensor) : n_tokens) * cfg_.d_model * sizeof(float);
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
      ce = ce / (float)(n_tokens * mesh.size(Axis::kData));
    }
  }
  pipe.broadcast(&ce, sizeof ce, stage_of(C - 1));
  return ce;
}

}  // namespace ls
