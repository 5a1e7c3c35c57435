// One rank of a ClusterTrainer: its model (its pieces of the tensors), its
// optimizer state and FSDP shards, its pipeline stage and its traffic.
// Internal to runner/cluster_*.cc.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "cluster/communicator.h"
#include "cluster/faulty_communicator.h"
#include "cluster/shared_chain.h"
#include "model/model.h"
#include "ops/device_memory.h"
#include "runner/cluster_trainer.h"
#include "runner/pipeline.h"
#include "runner/placement.h"

namespace ls {

// mesh.shared_memory: what a shard group whose ranks share a host's memory
// holds in it (cluster_shared.cc).
struct NodeShare {
  std::unique_ptr<SharedRegion> weights;  // the group's one copy of the weights
  std::unique_ptr<SharedRegion> grads;    // every rank's gradients, rank q's at q x stride floats
  std::unique_ptr<SharedRegion> flags;    // per rank and block, 64 bytes apart: the last pass that finished it
  Communicator* group = nullptr;          // the shard group (valid during a step: check_peers, barriers)
  size_t stride = 0;
  int ranks = 0, me = 0, blocks = 0;
  int64_t pass = 0;                  // training passes so far, the same count on every rank
  bool stale = true;                 // the shards changed since they were last published
  // The shared weights hold the master shards (published once from shard_w): the optimizer updates them in
  // place and publishing is a barrier, not a copy (ClusterTrainer::master_shard).
  bool master_in_place = false;
  std::vector<char> folded;          // per block, this pass: its gradients reduced
  const float* grads_of(int q) const { return (const float*)grads->data() + (size_t)q * stride; }
  int64_t* flag(int q, int block) const { return (int64_t*)(flags->data() + ((size_t)q * blocks + block) * 64); }
  bool finished(int q, int block) const { return flag_at_least(flag(q, block), pass); }  // in this pass
  void begin_pass() {
    ++pass;
    std::fill(folded.begin(), folded.end(), 0);
  }
};

struct ClusterTrainer::Rank {
  int index = 0;                    // in the world: MeshConfig::rank_coords
  MeshConfig::RankCoords at;       // its stage, data, context and tensor index
  std::unique_ptr<PipelineStage> stage;  // pipelined (mesh.pp > 1 or train.microbatches > 1): its blocks and schedule
  std::unique_ptr<MoeTransformer> model;
  ops::DeviceVector<float> m, v;    // AdamW moments for what this rank updates (shards with fsdp)
  // The authoritative parameter shards of the sharded tensors (FSDP, the sharded optimizer), concatenated;
  // with mesh.shared_memory only until the shared weights take them over (NodeShare::master_in_place).
  ops::DeviceVector<float> shard_w;
  std::vector<int64_t> shard_off;   // per tensor, offset of its range into m / v
  std::vector<int64_t> sharded_off;  // per sharded tensor, offset into shard_w / reduced (-1: not sharded)
  int64_t sharded_floats = 0;       // the sharded tensors' ranges, in all: the size of shard_w and reduced
  std::vector<Shard> shards;        // per tensor, its block range (every block without fsdp)
  CommStats comm;                   // bytes sent, accumulated over steps
  SplitNormBuffers norm_buffers;    // the gradient norm's buffers (split tensors, FSDP shards), reused step to step
  // mesh.overlap: collectives started during the step, per tensor (empty: none in flight).
  std::vector<Pending> reducing;    // its gradient's reduction, started as the backward finished it
  std::vector<Pending> gathering;   // its shards' all-gather, started before the forward
  ops::DeviceVector<float> reduced;  // sharded tensors' reduced gradient shards, at sharded_off
  std::vector<std::vector<size_t>> block_tensors;  // per block: its tensors (MoeTransformer::block_of)
  std::unique_ptr<NodeShare> node;  // mesh.shared_memory, once made (null: messages)
  bool node_tried = false;          // share_node_memory ran (once: a collective)
  std::unique_ptr<SharedChain> chain;  // mesh.shared_memory at tp > 1, once made (null: messages)
  bool chain_tried = false;
  std::unique_ptr<FaultyCommunicator> fault_tap;  // --debug-mesh-fault on this rank (runner/mesh_fault.h), or null
  bool fault_armed = false;                       // set at each step's start; the flipped message clears it
};

}  // namespace ls
