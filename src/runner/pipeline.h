// Pipeline parallelism (mesh.pp, train.microbatches, mesh.pp_schedule,
// mesh.pp_virtual): which blocks each stage holds, the order a stage runs
// its microbatches' passes in, and one stage's step.
//
// The bits do not depend on any of it. A microbatch is an aligned,
// power-of-two block of a rank's leaves, so its partial sums (the
// gradients, the loss, the router statistics) are nodes of the contract's
// leaf tree; the stage combines them by the canonical tree over
// microbatch index (contract.h's LeafTree), which is the rank's subtree.
// The aux loss's backward needs the step's expert counts over every
// microbatch: when the aux loss weighs in, a stage holds a chunk's first
// backward until every microbatch has run that chunk's forward
// (docs/CLUSTER.md, "Pipeline parallel").
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cluster/communicator.h"
#include "model/model.h"

namespace ls {


// One pass of one microbatch through one of the stage's model chunks.
struct PipelineAction {
  bool forward = true;
  int microbatch = 0;
  int chunk = 0;  // the stage's chunk k: model chunk k * stages + stage
};

// The order stage `stage` of `stages` runs its passes in, each of the
// `microbatches` through each of its `chunks` (1 but for interleaved):
// gpipe every forward, then every backward; 1f1b stages - stage - 1
// forwards, then alternating, then the remaining backwards; interleaved
// as Megatron-LM's interleaved 1F1B (microbatches a multiple of stages).
std::vector<PipelineAction> pipeline_order(PipelineSchedule schedule, int stages, int chunks, int microbatches,
                                           int stage);

// The model's blocks cut into `count` contiguous ranges [first, last),
// cut only where the residual stream alone crosses (the embedding, each
// layer's attention and MoE part, the head are the units), so that the
// costliest chunk is as cheap as it can be by the units' forward FLOPs per
// token (a formula). count <= 2 * n_layers + 2.
std::vector<std::pair<int, int>> pipeline_chunks(const ModelConfig& cfg, int count);

// The idle fraction of a stage the schedule's formula predicts (equal
// passes, free messages): (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1).
double pipeline_bubble_formula(PipelineSchedule schedule, int stages, int chunks, int microbatches);

// Buffers of a chunk's tensors its gradient tree over m microbatches holds:
// the binary counter's stack after k < m pushes has popcount(k) entries, and
// the next leaf one more, so floor(log2 m) + 1 (LeafTree::levels_for allows
// one more, never written here).
int gradient_tree_buffers(int microbatches);

// What one stage measured: the seconds are means per step over the steps
// after the first (a warm-up: buffers grow), or the first alone; the rest is
// the last step's.
struct PipelineStats {
  double busy_seconds = 0;       // inside forward and backward passes (and the gradient tree over microbatches)
  double step_seconds = 0;       // from the stage's first pass to its last, messages and waits included
  int peak_in_flight = 0;        // microbatches whose activations were held at once
  bool held = false;             // a backward waited for the expert counts (the aux loss)
  int64_t bytes_sent = 0;        // activations and gradients sent to the neighbouring stages
};

// One stage of one data-parallel (and tensor-parallel) rank.
class PipelineStage {
 public:
  // pipe: the ranks of this pipeline (same data and tensor-parallel index), by stage.
  PipelineStage(const ModelConfig& cfg, PipelineSchedule schedule, int stages, int chunks_per_stage,
                int microbatches, int stage);
  // The blocks this stage runs (its chunks' ranges), for the model it holds.
  std::vector<int> held_blocks() const;
  const std::vector<std::pair<int, int>>& chunks() const { return chunks_; }  // every model chunk's range

  // One training step over the rank's `samples` samples (tokens: theirs):
  // every microbatch's forward and backward, in the schedule's order. On
  // return the model's gradients are the rank's (its subtree over every
  // microbatch) and the losses are the step's, on every stage.
  // phase (may be empty): called with kForward and kBackward as the step's first pass of each kind begins.
  StepLosses train(MoeTransformer& model, const Mesh& mesh, Communicator& pipe, const uint8_t* tokens, int samples,
                   const std::function<void(TrainPhase)>& phase = {});
  // The mean cross-entropy of an evaluation batch (one microbatch), on every stage.
  float evaluate(MoeTransformer& model, const Mesh& mesh, Communicator& pipe, const uint8_t* tokens, int samples);
  const PipelineStats& stats() const { return stats_; }

 private:
  struct Step;
  int stage_of(int chunk) const { return chunk % stages_; }
  int model_chunk(int local) const { return local * stages_ + stage_; }

  ModelConfig cfg_;
  PipelineSchedule schedule_;
  int stages_, chunks_per_stage_, microbatches_, stage_;
  std::vector<std::pair<int, int>> chunks_;
  // Per chunk of this stage, its gradient tree's levels over microbatches:
  // kept between steps (fresh each step, the kernel zeroed their pages every
  // step; every entry is written before it is read).
  std::vector<std::vector<float>> tree_scratch_;
  PipelineStats stats_;
  int steps_run_ = 0;
  double busy_sum_ = 0, step_sum_ = 0;  // over the steps after the first
};

}  // namespace ls
