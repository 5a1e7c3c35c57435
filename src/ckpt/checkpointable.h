// The training state as the checkpointer sees it: the ranks that hold it,
// and the StatePiece a save stages and a restore delivers. The runner's
// trainers implement Checkpointable (runner/trainer.h); ckpt saves from it
// and restores into it, and needs nothing else of a trainer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ops/device_memory.h"

namespace ls {

// A piece of training state: elements [global_begin, global_end) of the
// flattened global tensor `name` ("param/<p>", "adam_m/<p>" or "adam_v/<p>").
struct StatePiece {
  std::string name;
  std::vector<int64_t> global_shape;
  int64_t global_begin = 0, global_end = 0;
  ops::StagingVector<float> data;  // the staged copy (empty for a restore need); page-locked on the GPU
};

// State spread over the ranks of a (simulated) job; a single-rank trainer has one.
class Checkpointable {
 public:
  virtual ~Checkpointable() = default;
  virtual int world() const { return 1; }
  // Copies the state into per-rank pieces (the part of a save that blocks
  // training); every global element is staged by exactly one rank. `out`
  // may hold the buffers of an earlier save: they are reused, so a save
  // touches no fresh memory.
  virtual void stage_state(std::vector<std::vector<StatePiece>>& out) = 0;
  // The global ranges rank `rank` holds (data empty): what a restore must
  // deliver to it, whatever mesh the checkpoint was saved on.
  virtual std::vector<StatePiece> state_needs(int rank) const = 0;
  virtual void load_piece(int rank, const StatePiece& need, const float* data) = 0;
};

}  // namespace ls
