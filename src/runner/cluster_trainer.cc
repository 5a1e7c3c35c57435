// Training on a simulated cluster: mesh.dp ranks (threads), each owning its
// model replica or shards, its slice of the batch and its optimizer state,
// talking only through a Communicator. Every sum over ranks is the canonical
// tree over rank index, every rank holds a power-of-two block of leaves, so
// the bits equal the single-rank engine's whatever the mesh.
#include "runner/cluster_trainer.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "cluster/communicator.h"
#include "common/error.h"
#include "contract.h"
#include "model/model.h"
#include "ops/device_memory.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "runner/pipeline.h"
#include "trace/sink.h"

namespace ls {
namespace {

// A rank's view of the mesh for its model.
class RankHooks : public MeshHooks {
 public:
  // stage: every rank of this pipeline stage, in data-parallel-major order;
  // with sequence parallel the stream's token sums span it.
  RankHooks(Communicator& world, Communicator& data, Communicator& ep_group, Communicator& tp_group,
            Communicator& cp_group, bool sp, bool cp_zigzag)
      : world_(world), data_(data), ep_(ep_group), tp_(tp_group), cp_(cp_group), sp_(sp), cp_zigzag_(cp_zigzag) {}
  int dp_size() const override { return data_.size(); }
  void sum_partials(float* v, size_t n) override { data_.all_reduce_sum(v, n); }
  void sum_counts(int64_t* v, size_t n) override { data_.all_reduce_sum(v, n); }
  int ep_size() const override { return ep_.size(); }
  int ep_rank() const override { return ep_.rank(); }
  void ep_all_to_all(const void* send, const std::vector<size_t>& sb, void* recv,
                     const std::vector<size_t>& rb) override {
    ep_.all_to_all(send, sb, recv, rb);
  }
  int tp_size() const override { return tp_.size(); }
  int tp_rank() const override { return tp_.rank(); }
  void tp_send(const float* buf, size_t n, int to) override { tp_.send(buf, n * sizeof(float), to); }
  void tp_recv(float* buf, size_t n, int from) override { tp_.recv(buf, n * sizeof(float), from); }
  void tp_broadcast(float* buf, size_t n, int root) override { tp_.broadcast(buf, n * sizeof(float), root); }
  bool sequence_parallel() const override { return sp_; }
  void tp_all_gather(const void* mine, void* all, size_t bytes_each) override {
    tp_.all_gather(mine, all, std::vector<size_t>(tp_.size(), bytes_each));
  }
  void sum_stream_partials(float* v, size_t n) override { (sp_ ? world_ : data_).all_reduce_sum(v, n); }
  void sum_tp_partials(float* v, size_t n) override { tp_.all_reduce_sum(v, n); }
  int cp_size() const override { return cp_.size(); }
  int cp_rank() const override { return cp_.rank(); }
  bool cp_zigzag() const override { return cp_zigzag_; }
  void cp_send(const float* buf, size_t n, int to) override { cp_.send(buf, n * sizeof(float), to); }
  void cp_recv(float* buf, size_t n, int from) override { cp_.recv(buf, n * sizeof(float), from); }
  void cp_all_gather(const float* mine, float* all, const std::vector<size_t>& n_each) override {
    std::vector<size_t> bytes(n_each);
    for (size_t& b : bytes) b *= sizeof(float);
    cp_.all_gather(mine, all, bytes);
  }

 private:
  Communicator& world_;
  Communicator& data_;
  Communicator& ep_;
  Communicator& tp_;
  Communicator& cp_;
  bool sp_, cp_zigzag_;
};

// FSDP shard of one tensor: the block range [b0, b1) of kParamBlock blocks.
struct Shard {
  int64_t b0 = 0, b1 = 0;
};

}  // namespace

struct ClusterTrainer::Rank {
  int index = 0;                    // in the world: MeshConfig::rank_coords
  int data_index = 0, tp_index = 0, pp_index = 0, cp_index = 0;
  std::unique_ptr<PipelineStage> stage;  // pipelined (mesh.pp > 1 or train.microbatches > 1): its blocks and schedule
  std::unique_ptr<MoeTransformer> model;
  ops::DeviceVector<float> m, v;    // AdamW moments for what this rank updates (shards with fsdp)
  ops::DeviceVector<float> shard_w;  // fsdp: the authoritative parameter shards, concatenated
  std::vector<int64_t> shard_off;   // fsdp: per tensor, offset into shard_w / m / v
  std::vector<Shard> shards;        // fsdp: per tensor, its block range
  CommStats comm;                   // bytes sent, accumulated over steps
};

namespace {

int64_t blocks_of(int64_t n) { return (n + kParamBlock - 1) / kParamBlock; }

// Which tensors FSDP shards: all but the expert slices of an expert-parallel mesh.
bool fsdp_sharded(const ParamInfo& p, const MeshConfig& mesh) { return mesh.fsdp && !(p.expert && mesh.ep > 1); }

// The tensor a tensor-parallel split tensor's parts make (its expert-parallel
// slice when experts are split too): part q (held by TP rank q) put in place.
void assemble_tp_parts(const ParamInfo& p, const float* parts, int tp, float* whole) {
  ParamInfo q = p;
  q.global_offset = 0;
  for (int rank = 0; rank < tp; ++rank) {
    q.tp_first = p.tp_held() * rank;
    const float* part = parts + (int64_t)rank * p.size;
    for (int64_t i = 0; i < p.size; ++i) whole[q.global_index(i)] = part[i];
  }
}

}  // namespace

ClusterTrainer::ClusterTrainer(const Scenario& s, Communicator* mpi) : s_(s), mpi_(mpi) {
  const MeshConfig& m = s.mesh;
  if (mpi && mpi->size() != m.world())
    throw std::logic_error("ClusterTrainer: the MPI world is not " + m.world_formula() + " (run_scenario checks)");
  if (m.fsdp && m.replicate > 1) {
    const int shard = m.dp / m.replicate;
    if (shard & (shard - 1))
      throw UserError("mesh.replicate: HSDP shard groups of mesh.dp / mesh.replicate = " + std::to_string(shard) +
                      " ranks must be a power of two to keep the reduction tree");
  }
  decay_steps_ = s.optim.decay_steps > 0 ? s.optim.decay_steps : s.steps;
  all_tensors_ = MoeTransformer::layout(s.model, m.ep, 0, m.tp, 0);
  const int ep = m.ep;
  const int group = m.fsdp ? m.dp / m.replicate : 1;
  for (int r = 0; r < m.world(); ++r) {
    if (mpi && r != mpi->rank()) {  // held by another process
      ranks_.push_back(nullptr);
      continue;
    }
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    const MeshConfig::RankCoords at = m.rank_coords(r);
    rank->pp_index = at.stage;
    rank->data_index = at.data;
    rank->cp_index = at.context;
    rank->tp_index = at.tensor;
    std::vector<int> blocks;  // empty: every block
    if (pipelined()) {
      rank->stage = std::make_unique<PipelineStage>(s.model, parse_pipeline_schedule(m.pp_schedule), m.pp, m.pp_virtual,
                                                    s.microbatches, rank->pp_index);
      blocks = rank->stage->held_blocks();
    }
    rank->model = std::make_unique<MoeTransformer>(s.model, s.leaf_samples, s.seed, ep, rank->data_index % ep, m.tp,
                                                   rank->tp_index, blocks);
    const auto& infos = rank->model->params();
    const int pos = rank->data_index % group;
    int64_t off = 0;
    for (const ParamInfo& p : infos) {
      const int64_t nb = blocks_of(p.size);
      Shard sh{0, nb};
      if (fsdp_sharded(p, m)) sh = {nb * pos / group, nb * (pos + 1) / group};
      rank->shards.push_back(sh);
      rank->shard_off.push_back(off);
      off += std::min(p.size, sh.b1 * kParamBlock) - std::min(p.size, sh.b0 * kParamBlock);
    }
    rank->m.assign(off, 0.0f);
    rank->v.assign(off, 0.0f);
    rank->shard_w.resize(off);
    for (size_t t = 0; t < infos.size(); ++t) {
      const auto [lo, hi] = range(*rank, t);
      std::copy(rank->model->weights() + infos[t].offset + lo, rank->model->weights() + infos[t].offset + hi,
                rank->shard_w.begin() + rank->shard_off[t]);
    }
    ranks_.push_back(std::move(rank));
  }
}

ClusterTrainer::~ClusterTrainer() = default;

std::pair<int64_t, int64_t> ClusterTrainer::range(const Rank& r, size_t t) const {
  const int64_t n = r.model->params()[t].size;
  return {std::min(n, r.shards[t].b0 * kParamBlock), std::min(n, r.shards[t].b1 * kParamBlock)};
}

double ClusterTrainer::train_flops_per_token() const { return ls::train_flops_per_token(s_.model); }

void ClusterTrainer::set_trace(TraceSink* sink) {
  if (sink)
    throw UserError("--trace: tracing a multi-rank or pipelined mesh is not supported yet; trace the same scenario on "
                    "one rank (mesh.* at 1 and train.microbatches=1), which must give the same bits");
}

void ClusterTrainer::debug_bump_weight(const std::string&, int64_t) {
  throw UserError("--debug-bump: only on one rank (mesh.* at 1 and train.microbatches=1)");
}

void ClusterTrainer::set_debug_reorder_moe_norm(bool on) {
  for (auto& r : ranks_)
    if (r) r->model->set_debug_reorder_moe_norm(on);
}

std::vector<std::unique_ptr<Communicator>> ClusterTrainer::split_groups(Communicator& world) const {
  const MeshConfig& m = s_.mesh;
  const int ep = m.ep, tp = m.tp, dp = m.dp, cp = m.cp;
  const int shard_size = m.fsdp ? dp / m.replicate : 1;
  const int me = world.rank();
  const MeshConfig::RankCoords at = m.rank_coords(me);
  const int data_rank = at.data;
  // Every group but the pipeline lies inside one stage; every data-parallel
  // group below holds ranks of one tensor and context-parallel index, in
  // data-parallel order. The context-parallel ranks of a data rank hold
  // the same state and end a step on the same gradients (what they split
  // they gather): each such slice reduces on its own.
  const int slice = (at.stage * cp + at.context) * tp + at.tensor;  // (stage, context index, tensor index)
  std::vector<std::unique_ptr<Communicator>> groups;
  groups.push_back(world.split(slice, me));                                              // data
  groups.push_back(world.split((at.stage * dp + data_rank) * cp + at.context, me));     // tp
  groups.push_back(world.split(slice * dp + data_rank / ep, me));                        // ep
  groups.push_back(world.split(slice * dp + data_rank % ep, me));                        // edp
  groups.push_back(world.split(slice * dp + data_rank / shard_size, me));                // shard
  groups.push_back(world.split(slice * dp + data_rank % shard_size, me));                // replica
  groups.push_back(world.split((data_rank * cp + at.context) * tp + at.tensor, me));     // pipe
  groups.push_back(world.split(at.stage * cp + at.context, me));                         // stage
  groups.push_back(world.split((at.stage * dp + data_rank) * tp + at.tensor, me));       // cp
  return groups;
}

void ClusterTrainer::run_rank(Communicator& world, const std::vector<std::unique_ptr<Communicator>>& groups,
                              const std::function<void(RankCtx&)>& body) {
  Rank& rank = *ranks_[world.rank()];
  std::vector<Communicator*> all = {&world};
  for (const auto& g : groups) all.push_back(g.get());
  // The communicators may outlive this call (MPI): count only what it sent.
  auto totals = [&](std::map<std::string, uint64_t>& bytes, std::map<std::string, uint64_t>& calls) {
    double seconds = 0;
    for (Communicator* c : all) {
      seconds += c->stats.seconds;
      for (auto& [k, b] : c->stats.bytes_sent) bytes[k] += b, calls[k] += c->stats.calls[k];
    }
    return seconds;
  };
  std::map<std::string, uint64_t> before_bytes, before_calls, after_bytes, after_calls;
  const double before_seconds = totals(before_bytes, before_calls);
  RankHooks hooks(*groups[7], *groups[0], *groups[2], *groups[1], *groups[8], s_.mesh.sp,
                  s_.mesh.cp_layout == "zigzag");
  rank.model->set_mesh(&hooks);
  RankCtx ctx{rank,       *groups[0], *groups[1], *groups[2], *groups[3], *groups[4],
              *groups[5], *groups[6], *groups[7], *groups[8], hooks};
  body(ctx);
  rank.model->set_mesh(nullptr);
  rank.comm.seconds += totals(after_bytes, after_calls) - before_seconds;
  for (auto& [k, b] : after_bytes) {
    rank.comm.bytes_sent[k] += b - before_bytes[k];
    rank.comm.calls[k] += after_calls[k] - before_calls[k];
  }
}

// Runs `body` once per rank with its communicators: its data-parallel
// group (one rank per data-parallel index, same tensor-parallel slice), its
// tensor-parallel group, its EP group, its expert-data-parallel group (same
// experts, other EP groups), its FSDP shard group and replica group. In
// process every rank is a thread; under MPI this process's one rank runs,
// its groups split once and kept (a split is a collective).
void ClusterTrainer::each_rank(const std::function<void(RankCtx&)>& body) {
  if (mpi_) {
    if (mpi_groups_.empty()) mpi_groups_ = split_groups(*mpi_);
    if (threads_ > 0) omp_set_num_threads(threads_);  // --threads is per process
    run_rank(*mpi_, mpi_groups_, body);
    return;
  }
  const int world = s_.mesh.world();
  const int threads_per_rank = std::max(1, (threads_ > 0 ? threads_ : omp_get_max_threads()) / world);
  run_in_process(
      world,
      [&](Communicator& comm) {
        omp_set_num_threads(threads_per_rank);
        run_rank(comm, split_groups(comm), body);
      },
      jitter_seed_);
}

namespace {

// Block counts of each rank of a shard group for a tensor of n elements.
std::vector<size_t> shard_elems(int64_t n, int g) {
  const int64_t nb = blocks_of(n);
  std::vector<size_t> out(g);
  for (int q = 0; q < g; ++q)
    out[q] = (size_t)(std::min(n, nb * (q + 1) / g * kParamBlock) - std::min(n, nb * q / g * kParamBlock));
  return out;
}

// whole = a tensor of n elements from its FSDP shards, each rank's block range (an all-gather).
void gather_shards(Communicator& shard, int64_t n, const float* mine, float* whole) {
  std::vector<size_t> bytes = shard_elems(n, shard.size());
  for (size_t& b : bytes) b *= sizeof(float);
  shard.all_gather(mine, whole, bytes);
}

}  // namespace

float ClusterTrainer::train_step(const uint8_t* tokens, int batch, int step, float* grad_norm) {
  const int local = batch / s_.mesh.dp;
  const int64_t sample_bytes = s_.model.seq_len + 1;
  float loss = 0, norm0 = 0;
  const bool ep_split = s_.mesh.ep > 1;
  each_rank([&](RankCtx& c) {
    Rank& rank = c.rank;
    MoeTransformer& model = *rank.model;
    const auto& infos = model.params();
    // FSDP: all-gather every sharded tensor from the shard group before use.
    for (size_t t = 0; t < infos.size(); ++t)
      if (fsdp_sharded(infos[t], s_.mesh))
        gather_shards(c.shard, infos[t].size, rank.shard_w.data() + rank.shard_off[t], model.weights() + infos[t].offset);
    if (phase_hook_) model.set_phase_hook([&](const char* phase) { phase_hook_(phase, rank.index); });
    const uint8_t* mine = tokens + (int64_t)rank.data_index * local * sample_bytes;
    const StepLosses l = rank.stage ? rank.stage->train(model, c.hooks, c.pipe, mine, local,
                                                        [&](const char* phase) {
                                                          if (phase_hook_) phase_hook_(phase, rank.index);
                                                        })
                                    : model.forward_backward(mine, local);
    model.set_phase_hook(nullptr);
    if (phase_hook_) phase_hook_("optimizer", rank.index);
    // Gradients: each rank's partials are subtrees; combine by the canonical
    // tree over ranks: all-reduce, or reduce-scatter for FSDP shards.
    float* g = model.grads();
    for (size_t t = 0; t < infos.size(); ++t) {
      const ParamInfo& p = infos[t];
      float* gp = g + p.offset;
      // Sequence parallel: a tensor the stream's tokens reduce into (embeddings, norms, router, head) has a
      // partial per TP rank; the TP group's leaves are consecutive aligned blocks (tp a power of two wherever
      // dp > 1), so its tree over TP ranks is this data-parallel rank's subtree, combined below as without SP.
      // (A pipeline did this per microbatch, before its tree over microbatches.)
      if (s_.mesh.sp && p.tp_mid == 0 && !rank.stage) c.tp.all_reduce_sum(gp, p.size);
      if (p.expert && ep_split) {
        c.edp.all_reduce_sum(gp, p.size);  // the replicas of these experts, one per EP group
      } else if (fsdp_sharded(p, s_.mesh)) {
        const std::vector<size_t> counts = shard_elems(p.size, c.shard.size());
        std::vector<float> mine(counts[c.shard.rank()]);
        c.shard.reduce_scatter_sum(gp, mine.data(), counts);
        if (c.replica.size() > 1) c.replica.all_reduce_sum(mine.data(), mine.size());  // HSDP
        std::copy(mine.begin(), mine.end(), gp + range(rank, t).first);
      } else {
        c.data.all_reduce_sum(gp, p.size);
      }
    }
    // Global norm, as AdamW::global_norm: per tensor the fma fold in blocks of
    // kParamBlock of the whole tensor, blocks by the canonical tree; tensors
    // added in canonical name order.
    std::vector<float> sumsqs(all_tensors_.size(), 0.0f);  // by canonical index
    for (size_t t = 0; t < infos.size(); ++t) {
      const ParamInfo& p = infos[t];
      const float* gp = g + p.offset;
      float sumsq;
      if (p.tp_mid > 0 || (p.expert && ep_split)) {
        // The whole tensor: the TP group's parts put in place, then the EP group's slices in rank order.
        ops::DeviceVector<float> slice, held;
        if (p.tp_mid > 0) {
          const float* part = gp;
          if (fsdp_sharded(p, s_.mesh)) {  // the reduced shards of the held part first
            held.resize(p.size);
            gather_shards(c.shard, p.size, gp + range(rank, t).first, held.data());
            part = held.data();
          }
          ops::DeviceVector<float> parts((size_t)p.size * c.tp.size());
          c.tp.all_gather(part, parts.data(), std::vector<size_t>(c.tp.size(), (size_t)p.size * 4));
          slice.resize(parts.size());
          assemble_tp_parts(p, parts.data(), c.tp.size(), slice.data());
        } else {
          slice.assign(gp, gp + p.size);
        }
        ops::DeviceVector<float> whole(slice.size() * (p.expert && ep_split ? c.ep.size() : 1));
        if (p.expert && ep_split)
          c.ep.all_gather(slice.data(), whole.data(), std::vector<size_t>(c.ep.size(), slice.size() * 4));
        else
          whole = std::move(slice);
        sumsq = ops::param_sumsq(whole.data(), (int64_t)whole.size());
      } else if (fsdp_sharded(p, s_.mesh)) {
        const int gs = c.shard.size();
        const int64_t nb = blocks_of(p.size);
        std::vector<float> mine;
        for (int64_t b = rank.shards[t].b0; b < rank.shards[t].b1; ++b)
          mine.push_back(sumsq_block(gp + b * kParamBlock, std::min<int64_t>(kParamBlock, p.size - b * kParamBlock)));
        std::vector<size_t> bytes(gs);
        for (int q = 0; q < gs; ++q) bytes[q] = (size_t)(nb * (q + 1) / gs - nb * q / gs) * 4;
        std::vector<float> all(nb);
        c.shard.all_gather(mine.data(), all.data(), bytes);
        sumsq = tree_sum(all.data(), nb);
      } else {
        sumsq = ops::param_sumsq(gp, p.size);
      }
      sumsqs[(size_t)p.index] = sumsq;
    }
    // Pipelined, each stage has its tensors' sums (the others +0): exact over the pipe.
    if (c.pipe.size() > 1) c.pipe.all_reduce_sum(sumsqs.data(), sumsqs.size());
    float total = 0.0f;
    for (float sumsq : sumsqs) total = total + sumsq;
    const float norm = ls::sqrt(total);
    // Clip and update what this rank owns (its shards; all of it without FSDP).
    const float scale = s_.optim.grad_clip > 0 && norm > s_.optim.grad_clip ? s_.optim.grad_clip / norm : 1.0f;
    const bool clip = s_.optim.grad_clip > 0 && norm > s_.optim.grad_clip;
    const float lr = learning_rate(s_.optim, decay_steps_, step);
    std::vector<AdamWSlice> slices;
    for (size_t t = 0; t < infos.size(); ++t) {
      const auto [lo, hi] = range(rank, t);
      float* w = fsdp_sharded(infos[t], s_.mesh) ? rank.shard_w.data() + rank.shard_off[t]
                                                 : model.weights() + infos[t].offset + lo;
      slices.push_back({w, g + infos[t].offset + lo, rank.m.data() + rank.shard_off[t],
                        rank.v.data() + rank.shard_off[t], hi - lo, infos[t].decay});
    }
    adamw_update(s_.optim, lr, step, clip, scale, slices);
    if (rank.index == 0) {
      loss = l.ce;
      norm0 = norm;
    }
  });
  if (mpi_) {  // rank 0's figures, on every process
    float both[2] = {loss, norm0};
    mpi_->broadcast(both, sizeof both, 0);
    loss = both[0];
    norm0 = both[1];
  }
  *grad_norm = norm0;
  return loss;
}

float ClusterTrainer::eval_loss(const uint8_t* tokens, int batch) {
  const int local = batch / s_.mesh.dp;
  const int64_t sample_bytes = s_.model.seq_len + 1;
  float loss = 0;
  each_rank([&](RankCtx& c) {
    MoeTransformer& model = *c.rank.model;
    const auto& infos = model.params();
    for (size_t t = 0; t < infos.size(); ++t)
      if (fsdp_sharded(infos[t], s_.mesh))
        gather_shards(c.shard, infos[t].size, c.rank.shard_w.data() + c.rank.shard_off[t],
                      model.weights() + infos[t].offset);
    const uint8_t* mine = tokens + (int64_t)c.rank.data_index * local * sample_bytes;
    const float ce = c.rank.stage ? c.rank.stage->evaluate(model, c.hooks, c.pipe, mine, local) : model.forward(mine, local).ce;
    if (c.rank.index == 0) loss = ce;
  });
  if (mpi_) mpi_->broadcast(&loss, sizeof loss, 0);
  return loss;
}

// Assembles the global tensors from the ranks' shards, as a checkpoint
// would, and hashes them canonically (contract rule 6).
std::string ClusterTrainer::state_hash() const {
  const MeshConfig& m = s_.mesh;
  const std::vector<ParamInfo>& all = all_tensors_;
  std::vector<std::vector<float>> param(all.size()), mom1(all.size()), mom2(all.size());
  for (size_t t = 0; t < all.size(); ++t) {
    int64_t global = 1;
    for (int64_t d : all[t].global_shape) global *= d;
    param[t].assign(global, 0.0f);
    mom1[t].assign(global, 0.0f);
    mom2[t].assign(global, 0.0f);
  }
  // Which ranks hold which part (of the tensors their pipeline stage
  // holds): EP slices from group 0's ranks; FSDP shards from shard group
  // 0's ranks; else data-parallel rank 0. Of a tensor-parallel split tensor
  // each TP rank holds a part; of the others TP rank 0 holds the copy.
  // Context-parallel ranks hold copies: index 0's count.
  auto holds = [&](int r, const ParamInfo& p) {
    const MeshConfig::RankCoords at = m.rank_coords(r);
    const int d = at.data;
    if (at.context != 0) return false;
    if (at.tensor != 0 && p.tp_mid == 0) return false;
    const bool expert_slice = p.expert && m.ep > 1;
    return !(expert_slice ? d >= m.ep : fsdp_sharded(p, m) ? d >= m.dp / m.replicate : d > 0);
  };
  // A holder's part of tensor t (canonical index): (first global element,
  // elements, the first middle index of a TP part or -1) and its weights, m, v.
  // A TP part's elements held_first .. held_first + n - 1 of the held tensor
  // (an FSDP shard of it), at start = the tensor's first global element.
  struct Part {
    int64_t t = 0, start = 0, n = 0, tp_first = -1, held_first = 0;
    const float *w = nullptr, *m1 = nullptr, *m2 = nullptr;
  };
  auto part_of = [&](const Rank& rk, size_t t) {
    const ParamInfo& q = rk.model->params()[t];
    const auto [lo, hi] = range(rk, t);
    const float* w = fsdp_sharded(q, m) ? rk.shard_w.data() + rk.shard_off[t] : rk.model->weights() + q.offset + lo;
    const bool split = q.tp_mid > 0;
    return Part{(int64_t)q.index, q.global_offset + (split ? 0 : lo), hi - lo, split ? q.tp_first : -1, split ? lo : 0, w,
                rk.m.data() + rk.shard_off[t], rk.v.data() + rk.shard_off[t]};
  };
  auto place = [&](const Part& p) {
    if (p.tp_first < 0) {
      std::copy(p.w, p.w + p.n, param[p.t].begin() + p.start);
      std::copy(p.m1, p.m1 + p.n, mom1[p.t].begin() + p.start);
      std::copy(p.m2, p.m2 + p.n, mom2[p.t].begin() + p.start);
      return;
    }
    ParamInfo q = all[p.t];  // the part's view of the tensor
    q.global_offset = p.start;
    q.tp_first = p.tp_first;
    for (int64_t i = 0; i < p.n; ++i) {
      const int64_t g = q.global_index(p.held_first + i);
      param[p.t][g] = p.w[i];
      mom1[p.t][g] = p.m1[i];
      mom2[p.t][g] = p.m2[i];
    }
  };
  if (!mpi_) {
    for (int r = 0; r < m.world(); ++r) {
      const auto& infos = ranks_[r]->model->params();
      for (size_t t = 0; t < infos.size(); ++t)
        if (holds(r, infos[t])) place(part_of(*ranks_[r], t));
    }
  } else {
    // Every process sends its parts to every other (an all-gather of
    // headers, then of the data): each then hashes the same global state.
    const int me = mpi_->rank(), R = mpi_->size();
    std::vector<int64_t> head;
    std::vector<float> data;
    const auto& infos = ranks_[me]->model->params();
    for (size_t t = 0; t < infos.size(); ++t)
      if (holds(me, infos[t])) {
        const Part p = part_of(*ranks_[me], t);
        head.insert(head.end(), {p.t, p.start, p.n, p.tp_first, p.held_first});
        for (const float* src : {p.w, p.m1, p.m2}) data.insert(data.end(), src, src + p.n);
      }
    std::vector<int64_t> sizes(2 * R), mine = {(int64_t)head.size(), (int64_t)data.size()};
    mpi_->all_gather(mine.data(), sizes.data(), std::vector<size_t>(R, 2 * sizeof(int64_t)));
    std::vector<size_t> hb(R), db(R);
    size_t htotal = 0, dtotal = 0;
    for (int r = 0; r < R; ++r) {
      hb[r] = (size_t)sizes[2 * r] * sizeof(int64_t);
      db[r] = (size_t)sizes[2 * r + 1] * sizeof(float);
      htotal += sizes[2 * r];
      dtotal += sizes[2 * r + 1];
    }
    std::vector<int64_t> heads(htotal);
    std::vector<float> gathered(dtotal);
    mpi_->all_gather(head.data(), heads.data(), hb);
    mpi_->all_gather(data.data(), gathered.data(), db);
    size_t at = 0;
    for (size_t h = 0; h + 4 < heads.size(); h += 5) {
      const int64_t n = heads[h + 2];
      place(Part{heads[h], heads[h + 1], n, heads[h + 3], heads[h + 4], &gathered[at], &gathered[at + n],
                 &gathered[at + 2 * n]});
      at += 3 * n;
    }
  }
  StateHasher hs;
  for (int kind = 0; kind < 3; ++kind)
    for (size_t t = 0; t < all.size(); ++t) {
      const char* prefix = kind == 0 ? "adam_m/" : kind == 1 ? "adam_v/" : "param/";
      const auto& data = kind == 0 ? mom1[t] : kind == 1 ? mom2[t] : param[t];
      hs.add(prefix + all[t].name, all[t].global_shape, data.data());
    }
  return hs.hex();
}

float* ClusterTrainer::storage(Rank& r, size_t t, const std::string& kind) const {
  const ParamInfo& p = r.model->params()[t];
  if (kind == "adam_m") return r.m.data() + r.shard_off[t];
  if (kind == "adam_v") return r.v.data() + r.shard_off[t];
  if (fsdp_sharded(p, s_.mesh)) return r.shard_w.data() + r.shard_off[t];
  return r.model->weights() + p.offset + range(r, t).first;
}

bool ClusterTrainer::stages(int rank, size_t t) const {
  const ParamInfo& p = ranks_[rank]->model->params()[t];
  const MeshConfig& m = s_.mesh;
  const MeshConfig::RankCoords at = m.rank_coords(rank);
  const int d = at.data;  // in its stage (each stage writes the tensors it holds)
  if (at.context != 0) return false;                      // context-parallel rank 0 writes what its group holds alike
  if (p.tp_mid == 0 && at.tensor != 0) return false;     // TP rank 0 writes what its group holds alike
  if (p.expert && m.ep > 1) return d < m.ep;             // EP group 0 holds one copy of each slice
  if (fsdp_sharded(p, m)) return d < m.dp / m.replicate;  // replica 0's shards
  if (p.tp_mid > 0) return d == 0;                        // each TP rank of data-parallel rank 0 writes a range
  return d == (int)(t % m.dp);                            // replicated: spread writers by tensor
}

// What rank `rank` holds, as global ranges: its range of each tensor; of a
// tensor-parallel split tensor, whose held part is strided, the whole
// tensor (its expert-parallel slice), from which load_piece keeps the part.
std::vector<StatePiece> ClusterTrainer::state_needs(int rank) const {
  std::vector<StatePiece> out;
  const Rank& r = *ranks_[rank];
  const auto& infos = r.model->params();
  for (const char* kind : {"param/", "adam_m/", "adam_v/"})
    for (size_t t = 0; t < infos.size(); ++t) {
      const ParamInfo& p = infos[t];
      const auto [lo, hi] = range(r, t);
      if (hi <= lo) continue;
      const int64_t end = p.tp_mid > 0 ? p.global_offset + p.size * s_.mesh.tp : p.global_offset + hi;
      out.push_back({kind + p.name, p.global_shape, p.global_offset + lo, end, {}});
    }
  return out;
}

// Every global element is staged once. A tensor-parallel split tensor is
// staged in contiguous ranges: each writing rank assembles the tensor (its
// expert-parallel slice) from its FSDP shard group's shards and its TP
// group's parts (all-gathers) and stages one of tp x (shard group size)
// near-equal ranges: TP rank q, shard position g stages range q x G + g.
void ClusterTrainer::stage_state(std::vector<std::vector<StatePiece>>& out) {
  out.resize(ranks_.size());
  for (size_t r = 0; r < ranks_.size(); ++r)
    if (!ranks_[r]) out[r].clear();  // another process's rank: it stages its own
  each_rank([&](RankCtx& c) {
    Rank& rank = c.rank;
    std::vector<StatePiece>& staged = out[(size_t)rank.index];
    const auto& infos = rank.model->params();
    size_t k = 0;  // pieces staged by this rank; buffers of an earlier save are reused in order
    ops::DeviceVector<float> held, parts, whole;
    for (const char* kind : {"param", "adam_m", "adam_v"})
      for (size_t t = 0; t < infos.size(); ++t) {
        const ParamInfo& p = infos[t];
        if (!stages(rank.index, t)) continue;
        const auto [lo, hi] = range(rank, t);
        const float* from = storage(rank, t, kind);
        StatePiece piece{std::string(kind) + "/" + p.name, p.global_shape, p.global_offset + lo, p.global_offset + hi, {}};
        if (p.tp_mid > 0) {  // collectives: every writing rank of the groups takes part, whatever it holds
          const bool sharded = fsdp_sharded(p, s_.mesh);
          if (sharded) {
            held.resize(p.size);
            gather_shards(c.shard, p.size, from, held.data());
            from = held.data();
          }
          parts.resize((size_t)p.size * c.tp.size());
          c.tp.all_gather(from, parts.data(), std::vector<size_t>(c.tp.size(), (size_t)p.size * 4));
          whole.resize(parts.size());
          assemble_tp_parts(p, parts.data(), c.tp.size(), whole.data());
          const int64_t ranges = (int64_t)c.tp.size() * (sharded ? c.shard.size() : 1);
          const int64_t mine = (int64_t)rank.tp_index * (ranges / c.tp.size()) + (sharded ? c.shard.rank() : 0);
          const int64_t total = (int64_t)whole.size(), begin = total * mine / ranges, end = total * (mine + 1) / ranges;
          from = whole.data() + begin;
          piece.global_begin = p.global_offset + begin;
          piece.global_end = p.global_offset + end;
        }
        if (piece.global_end <= piece.global_begin) continue;
        if (k == staged.size()) staged.emplace_back();
        ops::StagingVector<float> buffer = std::move(staged[k].data);
        buffer.resize(piece.global_end - piece.global_begin);
        ops::copy_to_host(buffer.data(), from, buffer.size() * sizeof(float));
        staged[k] = std::move(piece);
        staged[k].data = std::move(buffer);
        ++k;
      }
    staged.resize(k);
  });
}

void ClusterTrainer::load_piece(int rank, const StatePiece& need, const float* data) {
  Rank& r = *ranks_[rank];
  const auto& infos = r.model->params();
  const size_t slash = need.name.find('/');
  const std::string kind = need.name.substr(0, slash), name = need.name.substr(slash + 1);
  size_t t = 0;
  while (infos[t].name != name) ++t;
  const ParamInfo& p = infos[t];
  float* to = storage(r, t, kind);
  if (p.tp_mid == 0) {
    std::copy(data, data + (need.global_end - need.global_begin), to);
    return;
  }
  const auto [lo, hi] = range(r, t);  // the held part (an FSDP shard of it)
  for (int64_t i = lo; i < hi; ++i) to[i - lo] = data[p.global_index(i) - need.global_begin];
}

std::vector<int64_t> ClusterTrainer::tokens_per_expert() const {
  std::vector<int64_t> out;
  for (const auto& r : ranks_) {
    if (!r) continue;
    const auto& t = r->model->moe_stats().tokens_per_expert;
    if (out.empty()) out.assign(t.size(), 0);
    if (r->tp_index != 0 || r->cp_index != 0) continue;  // a tensor or context-parallel group routes its tokens once
    for (size_t i = 0; i < t.size(); ++i) out[i] += t[i];
  }
  if (mpi_) mpi_->all_reduce_sum(out.data(), out.size());  // every process's rank
  return out;
}

MeshReport ClusterTrainer::mesh_report() const {
  MeshReport rep;
  if (pipelined()) rep.pipeline.resize((size_t)s_.mesh.pp);
  if (s_.mesh.cp > 1) rep.context.resize((size_t)s_.mesh.cp);
  const int per_stage = s_.mesh.ranks_per_stage();
  if (mpi_) {  // every process's figures: a fixed record each, all-gathered
    const Rank& me = *ranks_[mpi_->rank()];
    const MoeStats& st = me.model->moe_stats();
    static const char* kKinds[] = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send"};
    constexpr size_t kFirstKind = 12, kKindCount = sizeof kKinds / sizeof *kKinds, kComm = kFirstKind + kKindCount;
    std::vector<int64_t> rec = {st.rounds, st.borrowed, st.dropped, st.expert_gemm_calls, st.all_to_all_calls,
                                st.all_to_all_bytes, st.peak_expert_bytes, st.peak_dispatch_bytes,
                                st.peak_routed_bytes, st.peak_grad_state_bytes, st.workspace_bytes, st.weight_bytes};
    for (const char* k : kKinds) rec.push_back(me.comm.bytes_sent.count(k) ? (int64_t)me.comm.bytes_sent.at(k) : -1);
    rec.push_back((int64_t)(me.comm.seconds * 1e9));  // nanoseconds in collectives
    const PipelineStats ps = me.stage ? me.stage->stats() : PipelineStats{};
    rec.insert(rec.end(), {(int64_t)(ps.busy_seconds * 1e9), (int64_t)(ps.step_seconds * 1e9), ps.peak_in_flight,
                           ps.bytes_sent, ps.held ? 1 : 0, (int64_t)(st.cp_attention_seconds * 1e9),
                           st.cp_bytes_sent, st.cp_kv_bytes_sent});
    const int R = mpi_->size();
    std::vector<int64_t> all(rec.size() * R);
    mpi_->all_gather(rec.data(), all.data(), std::vector<size_t>(R, rec.size() * sizeof(int64_t)));
    for (int r = 0; r < R; ++r) {
      const int64_t* x = &all[r * rec.size()];
      MoeStats s;
      s.rounds = (int)x[0];
      s.borrowed = x[1];
      s.dropped = x[2];
      s.expert_gemm_calls = x[3];
      s.all_to_all_calls = x[4];
      s.all_to_all_bytes = x[5];
      s.peak_expert_bytes = x[6];
      s.peak_dispatch_bytes = x[7];
      s.peak_routed_bytes = x[8];
      s.peak_grad_state_bytes = x[9];
      s.workspace_bytes = x[10];
      s.weight_bytes = x[11];
      const MeshConfig::RankCoords at = s_.mesh.rank_coords(r);
      rep.add(s, /*count_rows=*/at.tensor == 0 && at.context == 0);
      for (size_t k = 0; k < kKindCount; ++k)
        if (x[kFirstKind + k] >= 0)
          rep.bytes_sent_max[kKinds[k]] = std::max<uint64_t>(rep.bytes_sent_max[kKinds[k]], x[kFirstKind + k]);
      rep.comm_seconds_max = std::max(rep.comm_seconds_max, (double)x[kComm] * 1e-9);
      if (!rep.pipeline.empty())
        rep.pipeline[(size_t)(r / per_stage)].add(x[kComm + 1] * 1e-9, x[kComm + 2] * 1e-9, (int)x[kComm + 3], x[10],
                                                  x[kComm + 4], x[kComm + 5] != 0);
      if (!rep.context.empty()) rep.context[(size_t)at.context].add(x[kComm + 6] * 1e-9, x[kComm + 7], x[kComm + 8], x[10]);
    }
    return rep;
  }
  for (const auto& r : ranks_) {
    rep.add(r->model->moe_stats(), /*count_rows=*/r->tp_index == 0 && r->cp_index == 0);
    for (auto& [k, b] : r->comm.bytes_sent) rep.bytes_sent_max[k] = std::max(rep.bytes_sent_max[k], b);
    rep.comm_seconds_max = std::max(rep.comm_seconds_max, r->comm.seconds);
    if (!rep.context.empty()) {
      const MoeStats& st = r->model->moe_stats();
      rep.context[(size_t)r->cp_index].add(st.cp_attention_seconds, st.cp_bytes_sent, st.cp_kv_bytes_sent, st.workspace_bytes);
    }
    if (r->stage) {
      const PipelineStats& ps = r->stage->stats();
      rep.pipeline[(size_t)r->pp_index].add(ps.busy_seconds, ps.step_seconds, ps.peak_in_flight,
                                            r->model->moe_stats().workspace_bytes, ps.bytes_sent, ps.held);
    }
  }
  return rep;
}

}  // namespace ls
