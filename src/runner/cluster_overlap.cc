// mesh.overlap: a step's collectives started while the rank computes. The
// shards' all-gathers (FSDP, the sharded optimizer) start before the forward
// and are waited for as the forward enters each block; the first step of
// each tensor's gradient reduction (PlacementPlan) starts as the backward
// finishes its block and is waited for before the norm, its later steps
// (HSDP's replicas, dp_node's nodes) run then. The collectives, their trees over ranks and
// their order are the blocking path's, so the bits are too; only when they
// run changes (CommStats: exposed against in-flight time).

#include "model/model.h"
#include "runner/cluster_rank.h"
#include "runner/cluster_trainer.h"

namespace ls {

// A tensor smaller than this is reduced (and gathered) blocking: starting a
// collective costs a hand-off (in process, a thread's wake-up; under MPI a
// request) of tens of microseconds, about what 64 Ki floats take to copy.
constexpr int64_t kOverlapMinElements = 1 << 16;

bool ClusterTrainer::overlaps(const Rank& r) const { return s_.mesh.overlap && !r.stage; }

// p's first reduction step can run while the backward goes on: a group of
// the data axis, which the blocks never use (the tensor, expert and context
// groups carry their own exchanges during the backward).
bool ClusterTrainer::overlappable(const ParamInfo& p) const {
  if (p.size < kOverlapMinElements) return false;
  const Axis first = placement_.of(p).reduce.front().axis;
  return first == Axis::kData || first == Axis::kExpertData || first == Axis::kShard || first == Axis::kNode;
}

void ClusterTrainer::start_weight_gathers(RankCtx& c) {
  Rank& rank = c.rank;
  MoeTransformer& model = *rank.model;
  const auto& infos = model.params();
  rank.gathering.clear();
  rank.gathering.resize(infos.size());
  // In block order: the forward waits for the first block's tensors first.
  // (Gathering the small tensors before starting any was tried: under MPI it
  // moved no exposed time, in process it cost the quickstart shape's dp=2
  // about 20 %, the lane thread starting later.)
  for (const std::vector<size_t>& tensors : rank.block_tensors)
    for (size_t t : tensors) {
      if (!placement_.sharded(infos[t])) continue;
      const float* mine = rank.shard_w.data() + rank.sharded_off[t];
      float* whole = model.weights() + infos[t].offset;
      if (infos[t].size < kOverlapMinElements) gather_shards(c.group(Axis::kShard), infos[t].size, mine, whole);
      else rank.gathering[t] = start_gather_shards(c.group(Axis::kShard), infos[t].size, mine, whole);
    }
}

void ClusterTrainer::install_block_hooks(RankCtx& c) {
  Rank& rank = c.rank;
  rank.reducing.clear();
  rank.reducing.resize(rank.model->params().size());
  MoeTransformer::BlockHooks hooks;
  hooks.before_forward = [this, &rank](int b) {
    for (size_t t : rank.block_tensors[(size_t)b])
      if (t < rank.gathering.size() && rank.gathering[t]) {  // (none with mesh.shared_memory)
        rank.gathering[t]->wait();
        rank.gathering[t].reset();
      }
    progress(rank);
  };
  hooks.after_backward = [this, &c, &rank](int b) {
    if (rank.node) return node_block_done(rank, b);  // mesh.shared_memory: no collective to start
    for (size_t t : rank.block_tensors[(size_t)b])
      if (overlappable(rank.model->params()[t])) rank.reducing[t] = start_reduction(c, t);
    progress(rank);
  };
  rank.model->set_block_hooks(std::move(hooks));
}

Pending ClusterTrainer::start_reduction(RankCtx& c, size_t t) {
  Rank& rank = c.rank;
  const ParamInfo& p = rank.model->params()[t];
  float* gp = rank.model->grads() + p.offset;
  const ReduceStep& step = placement_.of(p).reduce.front();
  Communicator& group = c.group(step.axis);
  if (step.op == Collective::kAllReduce) return group.start_all_reduce_sum(gp, p.size);
  return group.start_reduce_scatter_sum(gp, reduced_shard(rank, t), PlacementPlan::shard_elems(p.size, group.size()));
}

// Under MPI a started collective moves only inside the library's calls:
// give every one in flight a turn between blocks.
void ClusterTrainer::progress(Rank& r) {
  for (std::vector<Pending>* v : {&r.gathering, &r.reducing})
    for (Pending& p : *v)
      if (p) p->test();
}

void ClusterTrainer::finish_reduction(RankCtx& c, size_t t) {
  Rank& rank = c.rank;
  rank.reducing[t]->wait();
  rank.reducing[t].reset();
  run_reduce_steps(c, t, 1);
}

void ClusterTrainer::abandon_in_flight(Rank& r) {
  r.gathering.clear();  // each waits for its collective (in process: the world fails first)
  r.reducing.clear();
  r.model->set_block_hooks({});
}

}  // namespace ls
