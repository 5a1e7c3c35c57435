// Training on a simulated cluster: mesh.dp ranks (threads), each owning its
// model replica or shards, its slice of the batch and its optimizer state,
// talking only through a Communicator. Every sum over ranks is the canonical
// tree over rank index, every rank holds a power-of-two block of leaves, so
// the bits equal the single-rank engine's whatever the mesh.
#include "runner/cluster_trainer.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <map>

#include "cluster/communicator.h"
#include "common/error.h"
#include "common/op_profile.h"
#include "contract.h"
#include "model/model.h"
#include "ops/device_memory.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "runner/cluster_rank.h"
#include "runner/pipeline.h"
#include "trace/sink.h"
#include "trace/writer.h"

namespace ls {

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
  decay_steps_ = decay_steps(s.optim, s.steps);
  all_tensors_ = place_params(s.model, m, MeshConfig::RankCoords{});
  placement_ = PlacementPlan(m, all_tensors_, pipelined());
  for (int r = 0; r < m.world(); ++r) {
    if (mpi && r != mpi->rank()) {  // held by another process
      ranks_.push_back(nullptr);
      continue;
    }
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    const MeshConfig::RankCoords at = m.rank_coords(r);
    rank->at = at;
    std::vector<int> blocks;  // empty: every block
    if (pipelined()) {
      rank->stage = std::make_unique<PipelineStage>(s.model, m.schedule(), m.pp, m.pp_virtual,
                                                    s.microbatches, rank->at.stage);
      blocks = rank->stage->held_blocks();
    }
    rank->model = std::make_unique<MoeTransformer>(s.model, s.leaf_samples, s.seed, place_params(s.model, m, at), blocks);
    const auto& infos = rank->model->params();
    // m and v cover every tensor's range; the master shards (and the reduced
    // gradients) only the sharded tensors': the others update in place.
    int64_t off = 0, sharded = 0;
    for (const ParamInfo& p : infos) {
      const Shard sh = placement_.shard(p, rank->at.data);
      const int64_t n = std::min(p.size, sh.b1 * kParamBlock) - std::min(p.size, sh.b0 * kParamBlock);
      rank->shards.push_back(sh);
      rank->shard_off.push_back(off);
      rank->sharded_off.push_back(placement_.sharded(p) ? sharded : -1);
      off += n;
      if (placement_.sharded(p)) sharded += n;
    }
    rank->m.assign(off, 0.0f);
    rank->v.assign(off, 0.0f);
    rank->shard_w.resize(sharded);
    rank->sharded_floats = sharded;
    rank->block_tensors.resize((size_t)rank->model->num_blocks());
    for (size_t t = 0; t < infos.size(); ++t)
      rank->block_tensors[(size_t)MoeTransformer::block_of(s.model, infos[t].name)].push_back(t);
    for (size_t t = 0; t < infos.size(); ++t) {
      if (rank->sharded_off[t] < 0) continue;
      const auto [lo, hi] = range(*rank, t);
      std::copy(rank->model->weights() + infos[t].offset + lo, rank->model->weights() + infos[t].offset + hi,
                rank->shard_w.begin() + rank->sharded_off[t]);
    }
    ranks_.push_back(std::move(rank));
  }
}

ClusterTrainer::~ClusterTrainer() = default;

std::pair<int64_t, int64_t> ClusterTrainer::range(const Rank& r, size_t t) const {
  return elements_of(r.shards[t], r.model->params()[t].size);
}

double ClusterTrainer::train_flops_per_token() const { return ls::train_flops_per_token(s_.model); }

// Every rank traces its pieces; a step's are assembled and written at its
// end (runner/mesh_trace.h), the weights and reduced gradients from the
// pieces the state hash places. Under MPI process 0 writes: the others'
// `sink` is never written to.
void ClusterTrainer::set_trace(TraceSink* sink) {
  mesh_trace_.reset();
  for (auto& r : ranks_)
    if (r) r->model->set_trace(nullptr);
  if (!sink) return;
  const auto* writer = dynamic_cast<const TraceWriter*>(sink);
  std::vector<std::string> names;
  for (const ParamInfo& p : all_tensors_) names.push_back(p.name);
  std::vector<MeshConfig::RankCoords> coords;
  for (int r = 0; r < s_.mesh.world(); ++r) coords.push_back(s_.mesh.rank_coords(r));
  mesh_trace_ = std::make_unique<MeshTrace>(sink, writer ? writer->path() + ".ranks" : std::string(), s_.model.n_layers,
                                            std::move(names), std::move(coords));
  mesh_trace_->set_processes(mpi_);
  for (auto& r : ranks_)
    if (r) r->model->set_trace(mesh_trace_->rank_sink(r->index), /*state=*/false);
}

void ClusterTrainer::debug_bump_weight(const std::string&, int64_t) {
  throw UserError("--debug-bump: only on one rank (mesh.* at 1 and train.microbatches=1)");
}

void ClusterTrainer::set_debug_reorder_moe_norm(bool on) {
  for (auto& r : ranks_)
    if (r) r->model->set_debug_reorder_moe_norm(on);
}

void ClusterTrainer::run_rank(Communicator& world, Mesh& mesh, const std::function<void(RankCtx&)>& body) {
  Rank& rank = *ranks_[world.rank()];
  attach_shared_chain(rank, mesh);
  tap_mesh_fault(mesh_fault_, mesh, &rank.fault_armed, &rank.fault_tap);
  std::vector<Communicator*> all = mesh.communicators();
  all.push_back(&world);
  // The communicators may outlive this call (MPI): count only what it sent.
  auto totals = [&] {
    CommStats sum;
    for (Communicator* c : all) {
      sum.seconds += c->stats.seconds;
      for (auto& [k, t] : c->stats.seconds_by_kind) sum.seconds_by_kind[k] += t;
      sum.in_flight_seconds += c->stats.in_flight_seconds;
      for (auto& [k, b] : c->stats.bytes_sent) sum.bytes_sent[k] += b, sum.calls[k] += c->stats.calls.at(k);
    }
    return sum;
  };
  CommStats before = totals();
  rank.model->set_mesh(&mesh);
  RankCtx ctx{rank, mesh};
  body(ctx);
  rank.model->set_mesh(nullptr);
  const CommStats after = totals();
  rank.comm.seconds += after.seconds - before.seconds;
  rank.comm.in_flight_seconds += after.in_flight_seconds - before.in_flight_seconds;
  for (auto& [k, t] : after.seconds_by_kind) rank.comm.seconds_by_kind[k] += t - before.seconds_by_kind[k];
  for (auto& [k, b] : after.bytes_sent) {
    rank.comm.bytes_sent[k] += b - before.bytes_sent[k];
    rank.comm.calls[k] += after.calls.at(k) - before.calls[k];
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
    if (!mpi_mesh_) mpi_mesh_ = std::make_unique<Mesh>(s_.mesh, *mpi_);
    if (threads_ > 0) omp_set_num_threads(threads_);  // --threads is per process
    run_rank(*mpi_, *mpi_mesh_, body);
    return;
  }
  const int world = s_.mesh.world();
  const int threads_per_rank = std::max(1, (threads_ > 0 ? threads_ : omp_get_max_threads()) / world);
  run_in_process(
      world,
      [&](Communicator& comm) {
        omp_set_num_threads(threads_per_rank);
        Mesh mesh(s_.mesh, comm);
        run_rank(comm, mesh, body);
      },
      jitter_seed_);
}

void ClusterTrainer::gather_sharded_weights(RankCtx& c) {
  if (share_node_memory(c)) return publish_weights(c);
  MoeTransformer& model = *c.rank.model;
  const auto& infos = model.params();
  for (size_t t = 0; t < infos.size(); ++t)
    if (placement_.sharded(infos[t]))
      gather_shards(c.group(Axis::kShard), infos[t].size, c.rank.shard_w.data() + c.rank.sharded_off[t],
                    model.weights() + infos[t].offset);
}

StepLosses ClusterTrainer::forward_backward(RankCtx& c, const uint8_t* samples, int count) {
  Rank& rank = c.rank;
  MoeTransformer& model = *rank.model;
  auto phase = [&](TrainPhase name) {
    if (phase_hook_) phase_hook_(name, rank.index);
  };
  if (phase_hook_) model.set_phase_hook(phase);
  const StepLosses l = rank.stage ? rank.stage->train(model, c.mesh, c.group(Axis::kPipeline), samples, count, phase)
                                  : model.forward_backward(samples, count);
  model.set_phase_hook(nullptr);
  return l;
}

// Where tensor t's reduced gradient shard lands (rank.reduced, kept step to
// step): the norm and the optimizer read it there.
float* ClusterTrainer::reduced_shard(Rank& r, size_t t) {
  if (r.reduced.size() != (size_t)r.sharded_floats) r.reduced.resize((size_t)r.sharded_floats);
  return r.reduced.data() + r.sharded_off[t];
}

// The reduced gradient of this rank's range of tensor t: its reduced shard
// when the tensor is sharded, else the gradients themselves.
float* ClusterTrainer::reduced_gradient(Rank& r, size_t t) {
  const ParamInfo& p = r.model->params()[t];
  if (placement_.sharded(p)) return r.reduced.data() + r.sharded_off[t];
  return r.model->grads() + p.offset + range(r, t).first;
}

// Each rank's partials are subtrees; they are combined by the canonical
// tree over ranks: the placement plan's steps, each an all-reduce or a
// reduce-scatter into this rank's shard (FSDP, the sharded optimizer).
void ClusterTrainer::reduce_gradients(RankCtx& c) {
  Rank& rank = c.rank;
  if (rank.node) {  // mesh.shared_memory: the shard group's step folded in place (cluster_shared.cc)
    fold_ready_blocks(rank, /*wait=*/true);
    if (c.group(Axis::kReplica).size() > 1)  // then the later steps, across shard groups (HSDP's replicas, nodes)
      for (size_t t = 0; t < rank.model->params().size(); ++t) run_reduce_steps(c, t, 1);
    return;
  }
  for (size_t t = 0; t < rank.model->params().size(); ++t) {
    if (t < rank.reducing.size() && rank.reducing[t]) {  // its first step started during the backward (mesh.overlap)
      finish_reduction(c, t);
      continue;
    }
    run_reduce_steps(c, t, 0);
  }
}

void ClusterTrainer::run_reduce_steps(RankCtx& c, size_t t, size_t first) {
  Rank& rank = c.rank;
  const ParamInfo& p = rank.model->params()[t];
  const std::vector<ReduceStep>& steps = placement_.of(p).reduce;
  float* sum = rank.model->grads() + p.offset;
  size_t n = (size_t)p.size;
  for (size_t k = 0; k < steps.size(); ++k) {
    Communicator& group = c.group(steps[k].axis);
    if (steps[k].op == Collective::kAllReduce) {
      if (k >= first) group.all_reduce_sum(sum, n);
      continue;
    }
    float* mine = reduced_shard(rank, t);  // the later steps sum this rank's shard
    if (k >= first) group.reduce_scatter_sum(sum, mine, PlacementPlan::shard_elems(p.size, group.size()));
    const auto [lo, hi] = range(rank, t);
    sum = mine, n = (size_t)(hi - lo);
  }
}

// The sum of squares of tensor t's reduced gradient, as AdamW::global_norm
// folds it: the fma fold in blocks of kParamBlock of the whole tensor, the
// blocks by the canonical tree.
float ClusterTrainer::gradient_sumsq(RankCtx& c, size_t t, bool* last_tp_rank_only) {
  Rank& rank = c.rank;
  const ParamInfo& p = rank.model->params()[t];
  const float* gp = rank.model->grads() + p.offset;
  switch (placement_.of(p).norm) {
    case NormFold::kHeld: return ops::param_sumsq(gp, p.size);
    case NormFold::kShardBlocks:  // this rank's blocks' folds, all-gathered, then the tree over every block
      return shared_blocks_sumsq(c.group(Axis::kShard), p.size, reduced_gradient(rank, t), rank.norm_buffers.own,
                                 rank.norm_buffers.sums);
    case NormFold::kSplitChain:  // each element sent at most once
      return split_tensor_sumsq(p, c.group(Axis::kTensor), gp, rank.norm_buffers, last_tp_rank_only);
    case NormFold::kGatherWhole: break;
  }
  // The whole tensor: the parts of the group that splits it put in place (with FSDP, the reduced shards of
  // the held part), then the EP group's slices in rank order.
  const bool ep_slice = p.split_over(Axis::kExpert);
  ops::DeviceVector<float> slice, held, parts;
  if (const TensorSplit* split = p.feature_split()) {
    const bool sharded = placement_.sharded(p);
    gather_tp_tensor(p, sharded, c.group(Axis::kShard), c.group(split->axis),
                     sharded ? reduced_gradient(rank, t) : gp, held, parts, slice);
  } else {
    slice.assign(gp, gp + p.size);
  }
  Communicator& expert = c.group(Axis::kExpert);
  ops::DeviceVector<float> whole(slice.size() * (ep_slice ? expert.size() : 1));
  if (ep_slice) all_gather_equal(expert, slice.data(), whole.data(), slice.size() * sizeof(float));
  else whole = std::move(slice);
  return ops::param_sumsq(whole.data(), (int64_t)whole.size());
}

// The global norm, as AdamW::global_norm: per tensor its sum of squares,
// tensors added in canonical name order.
float ClusterTrainer::gradient_norm(RankCtx& c) {
  const auto& infos = c.rank.model->params();
  std::vector<float> sumsqs(all_tensors_.size(), 0.0f);  // by canonical index
  std::vector<size_t> chained;                           // of those, the ones only the last TP rank holds
  for (size_t t = 0; t < infos.size(); ++t) {
    bool last_tp_rank_only = false;
    sumsqs[(size_t)infos[t].index] = gradient_sumsq(c, t, &last_tp_rank_only);
    if (last_tp_rank_only) chained.push_back((size_t)infos[t].index);
  }
  if (!chained.empty()) {  // the chains' sums, from the TP group's last rank, once for every tensor
    Communicator& tensor = c.group(Axis::kTensor);
    std::vector<float> sums;
    for (size_t i : chained) sums.push_back(sumsqs[i]);
    tensor.broadcast(sums.data(), sizeof(float) * sums.size(), tensor.size() - 1, "norm_chain");
    for (size_t k = 0; k < chained.size(); ++k) sumsqs[chained[k]] = sums[k];
  }
  // Pipelined, each stage has its tensors' sums (the others +0): exact over the pipe.
  c.group(Axis::kPipeline).all_reduce_sum(sumsqs.data(), sumsqs.size());
  return global_norm_of(sumsqs);
}

// Clip and update what this rank owns (its shards; all of it without FSDP).
void ClusterTrainer::update(RankCtx& c, int step, float norm) {
  Rank& rank = c.rank;
  MoeTransformer& model = *rank.model;
  const auto& infos = model.params();
  std::vector<AdamWSlice> slices;
  for (size_t t = 0; t < infos.size(); ++t) {
    const auto [lo, hi] = range(rank, t);
    float* w = placement_.sharded(infos[t]) ? master_shard(rank, t) : model.weights() + infos[t].offset + lo;
    slices.push_back({w, reduced_gradient(rank, t), rank.m.data() + rank.shard_off[t],
                      rank.v.data() + rank.shard_off[t], hi - lo, infos[t].decay});
  }
  adamw_step(s_.optim, decay_steps_, step, norm, slices);
  if (rank.node) rank.node->stale = true;  // published before the weights are next read
}

float ClusterTrainer::train_step(const uint8_t* tokens, int batch, int step, float* grad_norm) {
  const int local = batch / s_.mesh.dp;
  const int64_t sample_bytes = s_.model.seq_len + 1;
  float figures[2] = {0, 0};  // rank 0's loss and gradient norm
  if (mesh_trace_)  // the weights the step starts from
    for (const auto& r : ranks_)
      if (r) trace_state(*r, "params");
  for (const auto& r : ranks_)
    if (r) r->fault_armed = true;
  each_rank([&](RankCtx& c) {
    // Left by an exception, what is in flight is dropped (its peers released) on the way out.
    struct InFlight {
      Rank& rank;
      ~InFlight() {
        if (std::uncaught_exceptions() > 0) abandon_in_flight(rank);
      }
    } in_flight{c.rank};
    const bool overlap = overlaps(c.rank);
    if (share_node_memory(c)) {  // mesh.shared_memory: the shards published in place, the folds by block
      c.rank.node->begin_pass();
      publish_weights(c);
      if (overlap) install_block_hooks(c);
    } else if (overlap) {  // every sharded tensor, whole, before use: as the forward reaches it
      start_weight_gathers(c);
      install_block_hooks(c);
    } else {
      gather_sharded_weights(c);
    }
    const StepLosses l = forward_backward(c, tokens + (int64_t)c.rank.at.data * local * sample_bytes, local);
    if (overlap) c.rank.model->set_block_hooks({});
    if (phase_hook_) phase_hook_(TrainPhase::kOptimizer, c.rank.index);
    reduce_gradients(c);
    if (mesh_trace_) trace_state(c.rank, "grad");
    const float norm = gradient_norm(c);
    update(c, step, norm);
    if (c.rank.index == 0) figures[0] = l.ce, figures[1] = norm;
  });
  if (mpi_) mpi_->broadcast(figures, sizeof figures, 0);  // rank 0's figures, on every process
  if (mesh_trace_) mesh_trace_->flush();
  *grad_norm = figures[1];
  return figures[0];
}

float ClusterTrainer::eval_loss(const uint8_t* tokens, int batch) {
  const int local = batch / s_.mesh.dp;
  const int64_t sample_bytes = s_.model.seq_len + 1;
  float loss = 0;
  each_rank([&](RankCtx& c) {
    MoeTransformer& model = *c.rank.model;
    gather_sharded_weights(c);
    const uint8_t* mine = tokens + (int64_t)c.rank.at.data * local * sample_bytes;
    const float ce = c.rank.stage ? c.rank.stage->evaluate(model, c.mesh, c.group(Axis::kPipeline), mine, local)
                                  : model.forward(mine, local).ce;
    if (c.rank.index == 0) loss = ce;
  });
  if (mpi_) mpi_->broadcast(&loss, sizeof loss, 0);
  return loss;
}

std::vector<int64_t> ClusterTrainer::tokens_per_expert() const {
  std::vector<int64_t> out;
  for (const auto& r : ranks_) {
    if (!r) continue;
    const auto& t = r->model->moe_stats().tokens_per_expert;
    if (out.empty()) out.assign(t.size(), 0);
    if (r->at.tensor != 0 || r->at.context != 0) continue;  // a tensor or context-parallel group routes its tokens once
    for (size_t i = 0; i < t.size(); ++i) out[i] += t[i];
  }
  if (mpi_) mpi_->all_reduce_sum(out.data(), out.size());  // every process's rank
  return out;
}

namespace {
// The kinds whose exposed seconds a process's record carries (CommStats::seconds_by_kind).
constexpr const char* kTimeKinds[] = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                      "broadcast",  "send",           "recv",       "barrier", "norm_chain"};
}  // namespace

MeshReport ClusterTrainer::mesh_report() const {
  MeshReport rep;
  if (pipelined()) rep.pipeline.resize((size_t)s_.mesh.pp);
  if (s_.mesh.cp > 1) rep.context.resize((size_t)s_.mesh.cp);
  const int per_stage = s_.mesh.ranks_per_stage();
  if (mpi_) {  // every process's figures: a fixed record each, all-gathered
    const Rank& me = *ranks_[mpi_->rank()];
    const MoeStats& st = me.model->moe_stats();
    static const char* kKinds[] = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                   "broadcast",  "send",           "shared_send", "shared_final", "shared_gather",
                                   "shared_publish", "norm_chain", "shared_fold", "shared_fold_in_backward"};
    constexpr size_t kFirstKind = 12, kKindCount = sizeof kKinds / sizeof *kKinds, kComm = kFirstKind + kKindCount;
    std::vector<int64_t> rec = {st.rounds, st.borrowed, st.dropped, st.expert_gemm_calls, st.all_to_all_calls,
                                st.all_to_all_bytes, st.peak_expert_bytes, st.peak_dispatch_bytes,
                                st.peak_routed_bytes, st.peak_grad_state_bytes, st.workspace_bytes, st.weight_bytes};
    for (const char* k : kKinds) rec.push_back(me.comm.bytes_sent.count(k) ? (int64_t)me.comm.bytes_sent.at(k) : -1);
    rec.push_back((int64_t)(me.comm.seconds * 1e9));  // nanoseconds in collectives
    const PipelineStats ps = me.stage ? me.stage->stats() : PipelineStats{};
    rec.insert(rec.end(), {(int64_t)(ps.busy_seconds * 1e9), (int64_t)(ps.step_seconds * 1e9), ps.peak_in_flight,
                           ps.bytes_sent, ps.held ? 1 : 0, (int64_t)(st.cp_attention_seconds * 1e9),
                           st.cp_bytes_sent, st.cp_kv_bytes_sent, (int64_t)(me.comm.in_flight_seconds * 1e9)});
    const size_t kFirstTime = rec.size();  // then nanoseconds by kind, kTimeKinds' order
    for (const char* k : kTimeKinds)
      rec.push_back(me.comm.seconds_by_kind.count(k) ? (int64_t)(me.comm.seconds_by_kind.at(k) * 1e9) : 0);
    const size_t kFirstStreamOp = rec.size();
    rec.insert(rec.end(), st.stream_rows.begin(), st.stream_rows.end());
    rec.push_back(st.all_to_all_started);  // last but one
    rec.push_back(st.cp_link_messages);    // last
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
      s.all_to_all_started = x[rec.size() - 2];
      s.peak_expert_bytes = x[6];
      s.peak_dispatch_bytes = x[7];
      s.peak_routed_bytes = x[8];
      s.peak_grad_state_bytes = x[9];
      s.workspace_bytes = x[10];
      s.weight_bytes = x[11];
      std::copy(x + kFirstStreamOp, x + kFirstStreamOp + kStreamOps, s.stream_rows.begin());
      const MeshConfig::RankCoords at = s_.mesh.rank_coords(r);
      rep.add(s, /*count_rows=*/at.tensor == 0 && at.context == 0);
      for (size_t k = 0; k < kKindCount; ++k)
        if (x[kFirstKind + k] >= 0)
          rep.bytes_sent_max[kKinds[k]] = std::max<uint64_t>(rep.bytes_sent_max[kKinds[k]], x[kFirstKind + k]);
      rep.comm_seconds_max = std::max(rep.comm_seconds_max, (double)x[kComm] * 1e-9);
      rep.comm_in_flight_seconds_max = std::max(rep.comm_in_flight_seconds_max, (double)x[kComm + 9] * 1e-9);
      for (size_t k = 0; k < std::size(kTimeKinds); ++k)
        rep.comm_seconds_by_kind_max[kTimeKinds[k]] =
            std::max(rep.comm_seconds_by_kind_max[kTimeKinds[k]], (double)x[kFirstTime + k] * 1e-9);
      if (!rep.pipeline.empty())
        rep.pipeline[(size_t)(r / per_stage)].add(x[kComm + 1] * 1e-9, x[kComm + 2] * 1e-9, (int)x[kComm + 3], x[10],
                                                  x[kComm + 4], x[kComm + 5] != 0);
      if (!rep.context.empty())
        rep.context[(size_t)at.context].add(x[kComm + 6] * 1e-9, x[kComm + 7], x[kComm + 8], x[10], x[rec.size() - 1]);
    }
    return rep;
  }
  for (const auto& r : ranks_) {
    rep.add(r->model->moe_stats(), /*count_rows=*/r->at.tensor == 0 && r->at.context == 0);
    for (auto& [k, b] : r->comm.bytes_sent) rep.bytes_sent_max[k] = std::max(rep.bytes_sent_max[k], b);
    rep.comm_seconds_max = std::max(rep.comm_seconds_max, r->comm.seconds);
    rep.comm_in_flight_seconds_max = std::max(rep.comm_in_flight_seconds_max, r->comm.in_flight_seconds);
    for (auto& [k, t] : r->comm.seconds_by_kind) rep.comm_seconds_by_kind_max[k] = std::max(rep.comm_seconds_by_kind_max[k], t);
    if (!rep.context.empty()) {
      const MoeStats& st = r->model->moe_stats();
      rep.context[(size_t)r->at.context].add(st.cp_attention_seconds, st.cp_bytes_sent, st.cp_kv_bytes_sent, st.workspace_bytes,
                                             st.cp_link_messages);
    }
    if (r->stage) {
      const PipelineStats& ps = r->stage->stats();
      rep.pipeline[(size_t)r->at.stage].add(ps.busy_seconds, ps.step_seconds, ps.peak_in_flight,
                                            r->model->moe_stats().workspace_bytes, ps.bytes_sent, ps.held);
    }
  }
  return rep;
}

}  // namespace ls
