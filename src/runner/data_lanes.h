// Data-parallel lanes: one engine training step's forward and backward split
// over threads by samples, the way mesh.dp ranks split a batch. Each lane is a
// single-threaded model over consecutive samples, reading the one set of
// weights; lanes meet only where the model sums over every token (the MoE
// balance statistics and the loss, a few times per layer) and once at the end,
// where their gradients, subtrees of the contract's leaf tree, are combined
// by the canonical tree over lanes. On a small model this scales much better
// than splitting each op over threads: a step has ~90 ops of tens of
// microseconds each, and every split op ends in a wait for the slowest thread.
//
// The bits equal one model running the whole batch when each lane holds a
// power-of-two number of leaves (the rule mesh.dp follows) and the `drop`
// policy is off (its capacity counts the tokens one model sees). At
// numerics.level=local they do not (each lane's GEMMs see its own rows), so
// a traced step runs in lanes as an untraced one does: the lanes trace their
// pieces and the step is written in the one-rank format, as a mesh's is.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "model/model.h"
#include "trace/sink.h"

namespace ls {

// Lanes are on unless LOCKSTEP_DATA_LANES=0 is set or a test turns them off
// (to compare the two ways of using threads; the bits are the same).
bool data_lanes_enabled();
void set_data_lanes_enabled(bool on);

class DataLanes {
 public:
  // Lanes 1..lanes-1 (lane 0 is the caller's model): gradients and
  // workspaces of their own, weights read from the caller's model.
  DataLanes(const MoeTransformer& main, int lanes);
  ~DataLanes();
  int lanes() const { return lanes_; }

  // True when `lanes` lanes give one model's bits for this batch (and are worth
  // their memory: each lane keeps a gradient the size of the weights).
  static bool applicable(const ModelConfig& cfg, int leaf_samples, int64_t num_weights, int batch, int lanes);

  // Forward and backward of the whole batch: main runs lane 0; main.grads()
  // gets the batch's gradient and main.moe_stats() the batch's routing
  // statistics, as main.forward_backward(tokens, batch) would leave them.
  // trace: where the step's records go, the weights and gradients included
  // (nullptr: untraced); main's own sink must be unset meanwhile.
  StepLosses forward_backward(MoeTransformer& main, const uint8_t* tokens, int batch, TraceSink* trace = nullptr);

 private:
  class LaneGroup;
  friend class LaneGroup;
  // All lanes wait here; throws once a lane has failed (so none waits forever).
  void barrier();

  int lanes_;
  std::vector<std::unique_ptr<MoeTransformer>> models_;  // lanes 1..lanes-1
  std::vector<std::unique_ptr<LaneGroup>> groups_;       // one per lane: its mesh's data group
  std::vector<std::unique_ptr<Mesh>> meshes_;            // one per lane
  std::vector<const void*> posted_;                      // each lane's buffer in an exchange
  std::atomic<int> arrived_{0};
  std::atomic<uint64_t> barrier_gen_{0};
  std::atomic<bool> failed_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
};

}  // namespace ls
