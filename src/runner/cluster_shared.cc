// mesh.shared_memory: a shard group (the sharded optimizer's, a node's under
// mesh.dp_node, or FSDP's) whose ranks share a host's memory, as threads of
// one process or MPI processes of one node, keeps the weights once for the
// group and its ranks' gradients side by side. Instead of messages:
//   - the reduce-scatter: once every rank's backward finished a block, each
//     rank folds its share of the block's gradients straight from the
//     ranks' buffers, by the same canonical tree over ranks;
//   - the all-gather: each rank copies its updated shards into the shared
//     weights, and a barrier makes them everyone's.
// Where the state has copies across shard groups (HSDP's replicas, dp_node's
// nodes), each rank's folded shard is then all-reduced with them as messages,
// as the placement plan's next step. The trees and the order are the
// messages', so the bits are too; only what is copied and when changes. A rank's flag per block says which training
// pass last finished it (release store); its peers read it (acquire load).
//
// At numerics.level=local the group shares memory the same way (the usual
// way's transport on one host is the same memory) and each rank adds the
// ranks' gradients for its share left to right in rank order instead of by
// the tree: its folds still run as the peers finish each block, during the
// backward, as PyTorch DDP's buckets reduce.
//
// Why it is safe without more barriers: a rank folds a block only after
// every rank's backward finished it, and a rank reaches its next pass (where
// its gradients are overwritten and the shards republished) only after the
// gradient norm's all-gather, which every rank enters after all its folds.

#include "common/numerics_level.h"
#include "model/model.h"
#include "ops/dispatch.h"
#include "runner/cluster_rank.h"
#include "runner/cluster_trainer.h"

namespace ls {

bool ClusterTrainer::may_share_memory(const Rank& r) const {
  const MeshConfig& m = s_.mesh;
  if (!m.shared_memory || m.shard_group() < 2) return false;
  if (mesh_fault_ == MeshFault::kFsdpBlock) return false;  // the fault flips a message (runner/mesh_fault.h)
  // Not where a tensor needs another collective first (SP's TP partials), a
  // pipeline reduces per microbatch, or a kernel backend holds the buffers.
  if (m.sp || r.stage || ops::installed_kernels()) return false;
  for (const ParamInfo& p : r.model->params())
    if (!placement_.sharded(p)) return false;  // expert-parallel slices: all-reduced over their own group
  return true;
}

// The chain hands over at most the tokens' rows times (top-k + 2) at the
// model's width: token outputs (N x D) and routed rows (N x top-k x D).
void ClusterTrainer::attach_shared_chain(Rank& r, Mesh& mesh) {
  if (!r.chain_tried) {
    r.chain_tried = true;
    const MeshConfig& m = s_.mesh;
    // Not where --debug-mesh-fault flips one of the chain's messages (runner/mesh_fault.h).
    if (m.shared_memory && m.tp > 1 && !ops::installed_kernels() && !local_numerics() &&
        mesh_fault_ != MeshFault::kTpChain) {
      const int64_t tokens = (int64_t)s_.batch / m.dp * s_.model.seq_len;
      const int64_t floats = tokens * s_.model.d_model * (s_.model.top_k + 2);
      if (auto region = mesh.group(Axis::kTensor).share_memory(SharedChain::bytes_for(floats)))
        r.chain = std::make_unique<SharedChain>(std::move(region), floats);
    }
  }
  mesh.set_shared_chain(r.chain.get());
}

bool ClusterTrainer::share_node_memory(RankCtx& c) {
  Rank& rank = c.rank;
  if (rank.node) {
    rank.node->group = &c.group(Axis::kShard);
    return true;
  }
  if (rank.node_tried || !may_share_memory(rank)) return false;
  rank.node_tried = true;
  Communicator& shard = c.group(Axis::kShard);
  MoeTransformer& model = *rank.model;
  auto node = std::make_unique<NodeShare>();
  const size_t n = (size_t)model.num_weights();
  node->weights = shard.share_memory(n * sizeof(float));
  if (!node->weights) return false;  // (the same answer on every rank of the group)
  node->ranks = shard.size();
  node->me = shard.rank();
  node->blocks = model.num_blocks();
  node->stride = (n + 15) / 16 * 16;  // 64-byte aligned per rank
  node->grads = shard.share_memory(node->stride * node->ranks * sizeof(float));
  node->flags = shard.share_memory((size_t)node->ranks * node->blocks * 64);
  node->folded.assign((size_t)node->blocks, 0);
  node->group = &shard;
  model.place_storage((float*)node->weights->data(),
                      (float*)node->grads->data() + (size_t)node->me * node->stride);
  rank.node = std::move(node);
  return true;
}

void ClusterTrainer::publish_weights(RankCtx& c) {
  Rank& rank = c.rank;
  NodeShare& node = *rank.node;
  if (!node.stale) return;
  if (!node.master_in_place) {  // once: the shards into the shared weights, which hold them from then on
    const auto& infos = rank.model->params();
    for (size_t t = 0; t < infos.size(); ++t) {
      const auto [lo, hi] = range(rank, t);
      const float* mine = rank.shard_w.data() + rank.sharded_off[t];
      std::copy(mine, mine + (hi - lo), rank.model->weights() + infos[t].offset + lo);
      rank.comm.count("shared_publish", sizeof(float) * (uint64_t)(hi - lo));
    }
    node.master_in_place = true;
    ops::DeviceVector<float>().swap(rank.shard_w);  // (master_shard points into the shared weights now)
  }
  node.group->barrier();  // every rank's shards are in
  node.stale = false;
}

// The optimizer writes a shard into the shared weights only after every
// rank's backward is done with them: it runs after the gradient norm, which
// every rank enters after its last fold, i.e. after its backward.
float* ClusterTrainer::master_shard(const Rank& r, size_t t) const {
  if (r.node && r.node->master_in_place) return r.model->weights() + r.model->params()[t].offset + range(r, t).first;
  return const_cast<float*>(r.shard_w.data()) + r.sharded_off[t];
}

// This rank's backward finished `block` (its gradients written): say so,
// then fold whatever every rank has finished (while blocks below are still
// to compute: in the backward).
void ClusterTrainer::node_block_done(Rank& r, int block) {
  NodeShare& node = *r.node;
  publish_flag(node.flag(node.me, block), node.pass);
  fold_ready_blocks(r, /*wait=*/false, /*in_backward=*/block > 0);
}

// Folds this rank's share of each block every rank has finished, in the
// order the backward finishes them (last block first); wait: all of them,
// waiting for the peers (exposed time, as a reduce-scatter's wait). Counts
// the bytes read from the peers as `shared_fold` (a reduce-scatter would
// have received them), and as `shared_fold_in_backward` too when the
// backward still has blocks to run.
void ClusterTrainer::fold_ready_blocks(Rank& r, bool wait, bool in_backward) {
  NodeShare& node = *r.node;
  const auto& infos = r.model->params();
  std::vector<const float*> parts((size_t)node.ranks);
  for (int b = node.blocks - 1; b >= 0; --b) {
    if (node.folded[(size_t)b]) continue;
    if (!node.finished(node.me, b)) {
      if (!wait) continue;
      publish_flag(node.flag(node.me, b), node.pass);  // without hooks: the whole backward is done
    }
    auto ready = [&] {
      for (int q = 0; q < node.ranks; ++q)
        if (!node.finished(q, b)) return false;
      return true;
    };
    if (!ready() && !wait) continue;
    node.flags->wait_until(node.group->stats, "reduce_scatter", ready);
    for (size_t t : r.block_tensors[(size_t)b]) {
      const auto [lo, hi] = range(r, t);
      for (int q = 0; q < node.ranks; ++q) parts[(size_t)q] = node.grads_of(q) + infos[t].offset + lo;
      if (local_numerics()) sum_in_rank_order(parts.data(), node.ranks, 0, (size_t)(hi - lo), reduced_shard(r, t));
      else tree_over_ranks(parts.data(), node.ranks, 0, (size_t)(hi - lo), reduced_shard(r, t));
      const uint64_t peers = sizeof(float) * (uint64_t)(hi - lo) * (uint64_t)(node.ranks - 1);
      r.comm.count("shared_fold", peers);
      if (in_backward) r.comm.count("shared_fold_in_backward", peers);
    }
    node.folded[(size_t)b] = 1;
  }
}

}  // namespace ls
