// A Trainer over a simulated cluster (scenario keys mesh.*): data-parallel
// ranks with optional expert parallelism, FSDP/HSDP sharding and tensor
// parallelism, run as in-process threads (or MPI processes) that share
// nothing but a Communicator.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cluster/communicator.h"
#include "cluster/mesh.h"
#include "model/model.h"
#include "runner/mesh_fault.h"
#include "runner/mesh_trace.h"
#include "runner/placement.h"
#include "runner/runner.h"

namespace ls {

class ClusterTrainer : public Trainer {
 public:
  // mpi: this process is rank mpi->rank() of an MPI world of
  // mesh.world() processes and holds that rank alone; nullptr: every rank
  // is a thread here. World ranks are laid out as MeshConfig::rank_coords says.
  explicit ClusterTrainer(const Scenario& s, Communicator* mpi = nullptr);
  ~ClusterTrainer() override;

  float train_step(const uint8_t* tokens, int batch, int step, float* grad_norm) override;
  float eval_loss(const uint8_t* tokens, int batch) override;
  std::string state_hash() const override;
  double train_flops_per_token() const override;
  std::vector<int64_t> tokens_per_expert() const override;
  void set_trace(TraceSink* sink) override;
  void debug_bump_weight(const std::string& param, int64_t index) override;
  void set_debug_reorder_moe_norm(bool on) override;
  void set_debug_mesh_fault(MeshFault f) { mesh_fault_ = f; }  // --debug-mesh-fault (runner/mesh_fault.h)

  void set_threads(int threads) { threads_ = threads; }
  // Nonzero: every collective sleeps a random few microseconds per rank.
  void set_jitter(uint64_t seed) { jitter_seed_ = seed; }
  MeshReport mesh_report() const override;
  int world() const override { return s_.mesh.world(); }
  void stage_state(std::vector<std::vector<StatePiece>>& out) override;
  std::vector<StatePiece> state_needs(int rank) const override;
  void load_piece(int rank, const StatePiece& need, const float* data) override;
  void set_phase_hook(std::function<void(TrainPhase, int)> hook) override { phase_hook_ = std::move(hook); }

  // A rank's piece of a tensor as the state hash places it (cluster_state.cc).
  struct StatePart;

 private:
  struct Rank;
  struct RankCtx {
    Rank& rank;
    const Mesh& mesh;  // its groups, one per axis
    Communicator& group(Axis a) const { return mesh.group(a); }
  };
  // body on every rank (threads), or on this process's one rank (MPI).
  void each_rank(const std::function<void(RankCtx&)>& body);
  // body on world.rank()'s rank; its communicators' traffic during the call
  // is added to the rank's.
  void run_rank(Communicator& world, Mesh& mesh, const std::function<void(RankCtx&)>& body);
  // One training step on a rank, in order: FSDP's weights gathered, the
  // forward and backward (a pipeline stage's schedule when pipelined), the
  // gradients reduced over the mesh, their global norm, the update.
  void gather_sharded_weights(RankCtx& c);
  StepLosses forward_backward(RankCtx& c, const uint8_t* samples, int count);
  void reduce_gradients(RankCtx& c);
  // Tensor t's reduction steps (PlacementPlan) from step `first` on: 1 once the first ran overlapped.
  void run_reduce_steps(RankCtx& c, size_t t, size_t first);
  // mesh.overlap (cluster_overlap.cc): the shards' all-gathers started before
  // the forward and waited for block by block; each tensor's gradient
  // reduction's first step started as the backward finishes its block, on a
  // group the blocks do not use (overlappable), and waited for, its other
  // steps run after, in reduce_gradients.
  bool overlaps(const Rank& r) const;
  bool overlappable(const ParamInfo& p) const;
  void start_weight_gathers(RankCtx& c);
  void install_block_hooks(RankCtx& c);
  Pending start_reduction(RankCtx& c, size_t tensor);
  static void progress(Rank& r);
  void finish_reduction(RankCtx& c, size_t tensor);
  // Tensor t's reduced gradient shard (FSDP, the sharded optimizer) and its copy into the gradients.
  float* reduced_shard(Rank& r, size_t tensor);
  // Where this rank's master shard of sharded tensor t lives: shard_w, or the shared weights once they hold it.
  float* master_shard(const Rank& r, size_t tensor) const;
  float* reduced_gradient(Rank& r, size_t tensor);
  // mesh.shared_memory (cluster_shared.cc): a shard group on one host
  // shares one weights buffer and folds each block's gradients straight
  // from its ranks' buffers once every rank's backward finished the block.
  bool may_share_memory(const Rank& r) const;
  bool share_node_memory(RankCtx& c);  // made on the first call; false: messages as before
  void publish_weights(RankCtx& c);    // this rank's updated shards into the shared weights
  void node_block_done(Rank& r, int block);
  // The tensor group's shared hand-off region for the chain (cluster/shared_chain.h), made once.
  void attach_shared_chain(Rank& r, Mesh& mesh);
  // in_backward: called between the backward's blocks, with more to run (counted as such).
  void fold_ready_blocks(Rank& r, bool wait, bool in_backward = false);
  // What a rank left in flight, dropped (an exception on the way out).
  static void abandon_in_flight(Rank& r);
  // last_tp_rank_only: may return a sum only the TP group's last rank holds (split_tensor_sumsq's chain).
  float gradient_sumsq(RankCtx& c, size_t tensor, bool* last_tp_rank_only = nullptr);
  float gradient_norm(RankCtx& c);
  void update(RankCtx& c, int step, float norm);

  // The state hash's pieces (cluster_state.cc).
  std::vector<StatePart> state_parts(const Rank& r, bool gradients = false) const;
  // --trace: the weights or reduced gradients of rank r, as pieces of the mesh trace.
  void trace_state(const Rank& r, const char* phase) const;
  std::vector<StatePart> all_processes_parts(const std::vector<StatePart>& mine, std::vector<float>& data) const;

  std::pair<int64_t, int64_t> range(const Rank& r, size_t tensor) const;  // elements this rank owns
  // Where rank r keeps kind ("param", "adam_m", "adam_v") of tensor t's owned range.
  float* storage(Rank& r, size_t tensor, const std::string& kind) const;
  bool pipelined() const { return s_.mesh.pp > 1 || s_.microbatches > 1; }

  Scenario s_;
  PlacementPlan placement_;
  int decay_steps_ = 0;
  std::vector<ParamInfo> all_tensors_;  // every tensor of the model, canonical order, as TP and EP rank 0 hold it
  int threads_ = 0;
  uint64_t jitter_seed_ = 0;
  std::vector<std::unique_ptr<Rank>> ranks_;  // under MPI only this process's rank is non-null
  Communicator* mpi_ = nullptr;
  MeshFault mesh_fault_ = MeshFault::kNone;  // --debug-mesh-fault
  std::unique_ptr<Mesh> mpi_mesh_;  // under MPI: this process's groups, split once
  std::function<void(TrainPhase, int)> phase_hook_;
  std::unique_ptr<MeshTrace> mesh_trace_;  // --trace: the ranks' pieces, assembled step by step
};

}  // namespace ls
