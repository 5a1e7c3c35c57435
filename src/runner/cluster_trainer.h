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
#include "model/model.h"
#include "runner/runner.h"

namespace ls {

class ClusterTrainer : public Trainer {
 public:
  // mpi: this process is rank mpi->rank() of an MPI world of mesh.dp x
  // mesh.tp x mesh.pp processes and holds that rank alone; nullptr: every
  // rank is a thread here. World rank r = s * (dp * tp) + d * tp + t:
  // pipeline stage s, data-parallel rank d, tensor-parallel rank t.
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

  void set_threads(int threads) { threads_ = threads; }
  // Nonzero: every collective sleeps a random few microseconds per rank.
  void set_jitter(uint64_t seed) { jitter_seed_ = seed; }
  MeshReport mesh_report() const override;
  int world() const override { return s_.mesh.world(); }
  void stage_state(std::vector<std::vector<StatePiece>>& out) override;
  std::vector<StatePiece> state_needs(int rank) const override;
  void load_piece(int rank, const StatePiece& need, const float* data) override;
  void set_phase_hook(std::function<void(const char*, int)> hook) override { phase_hook_ = std::move(hook); }

 private:
  struct Rank;
  struct RankCtx {
    Rank& rank;
    Communicator& data;     // the data-parallel ranks holding the same tensor and context-parallel slice (mesh.dp)
    Communicator& tp;       // the tensor-parallel group: the ranks of one data-parallel rank (size mesh.tp)
    Communicator& ep;       // ranks sharing the experts (consecutive data-parallel ranks, size mesh.ep)
    Communicator& edp;      // ranks holding the same experts, one per EP group
    Communicator& shard;    // FSDP shard group
    Communicator& replica;  // HSDP replicas of my shard
    Communicator& pipe;     // the pipeline: the ranks of my data, context and tensor-parallel index, by stage (mesh.pp)
    Communicator& stage;    // the ranks of my pipeline stage and context-parallel index (size mesh.dp x mesh.tp)
    Communicator& cp;       // the context-parallel group: the ranks of one data and tensor-parallel index (mesh.cp)
    MeshHooks& hooks;       // the model's view of these groups
  };
  void each_rank(const std::function<void(RankCtx&)>& body);
  // world's sub-groups, in RankCtx's order: data, tp, ep, edp, shard, replica, pipe, stage, cp.
  std::vector<std::unique_ptr<Communicator>> split_groups(Communicator& world) const;
  // body on world.rank()'s rank; its communicators' traffic during the call
  // is added to the rank's.
  void run_rank(Communicator& world, const std::vector<std::unique_ptr<Communicator>>& groups,
                const std::function<void(RankCtx&)>& body);
  std::pair<int64_t, int64_t> range(const Rank& r, size_t tensor) const;  // elements this rank owns
  // Where rank r keeps kind ("param", "adam_m", "adam_v") of tensor t's owned range.
  float* storage(Rank& r, size_t tensor, const std::string& kind) const;
  bool stages(int rank, size_t tensor) const;  // the one rank that writes this range to a checkpoint
  bool pipelined() const { return s_.mesh.pp > 1 || s_.microbatches > 1; }

  Scenario s_;
  int decay_steps_ = 0;
  std::vector<ParamInfo> all_tensors_;  // every tensor of the model, canonical order, as TP and EP rank 0 hold it
  int threads_ = 0;
  uint64_t jitter_seed_ = 0;
  std::vector<std::unique_ptr<Rank>> ranks_;  // under MPI only this process's rank is non-null
  Communicator* mpi_ = nullptr;
  std::vector<std::unique_ptr<Communicator>> mpi_groups_;  // ep, edp, shard, replica: split once
  std::function<void(const char*, int)> phase_hook_;
};

}  // namespace ls
