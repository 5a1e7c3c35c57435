// The simulated cluster's layout (scenario keys mesh.*).
#pragma once

#include <string>

namespace ls {

struct MeshConfig {
  int dp = 1;          // data-parallel ranks (the world): each holds batch/dp consecutive samples
  int ep = 1;          // expert-parallel group size: consecutive ranks sharing the experts
  bool fsdp = false;   // shard parameters, gradients and optimizer state (ZeRO-3 style)
  int replicate = 1;   // with fsdp: replica groups (HSDP); shards span dp/replicate ranks
  int tp = 1;          // tensor-parallel ranks per data-parallel rank (heads and hidden features split)
  bool sp = false;     // sequence parallel: with tp, norms, residuals, router and head on tokens split across tp
  int pp = 1;          // pipeline stages: each holds a contiguous range of the model's blocks
  std::string pp_schedule = "1f1b";  // gpipe | 1f1b | interleaved: the order a stage runs its microbatches in
  int pp_virtual = 1;  // interleaved: model chunks per stage
  int cp = 1;          // context-parallel ranks per data-parallel rank: attention's query positions split across them
  std::string cp_layout = "zigzag";  // zigzag | contiguous: which positions each context-parallel rank holds
  int world() const { return dp * tp * pp * cp; }
  // "mesh.dp x mesh.tp x mesh.pp = 4 x 1 x 2 = 8" (and "x mesh.cp" when it is
  // above 1), for messages.
  std::string world_formula() const {
    const bool c = cp > 1;
    return std::string("mesh.dp x mesh.tp x mesh.pp") + (c ? " x mesh.cp" : "") + " = " + std::to_string(dp) + " x " +
           std::to_string(tp) + " x " + std::to_string(pp) + (c ? " x " + std::to_string(cp) : std::string()) +
           " = " + std::to_string(world());
  }

  // Where world rank r sits: r = ((stage * dp + data) * cp + context) * tp + tensor.
  // Tensor-parallel ranks are neighbours, then context-parallel ranks, then
  // data-parallel ones; a pipeline stage is a contiguous block of ranks.
  struct RankCoords {
    int stage = 0, data = 0, context = 0, tensor = 0;
  };
  RankCoords rank_coords(int r) const {
    return {r / (dp * cp * tp), r / (cp * tp) % dp, r / tp % cp, r % tp};
  }
  int ranks_per_stage() const { return dp * cp * tp; }
};

}  // namespace ls
