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
  int world() const { return dp * tp * pp; }
  // "mesh.dp x mesh.tp x mesh.pp = 4 x 1 x 2 = 8", for messages.
  std::string world_formula() const {
    return "mesh.dp x mesh.tp x mesh.pp = " + std::to_string(dp) + " x " + std::to_string(tp) + " x " +
           std::to_string(pp) + " = " + std::to_string(world());
  }
};

}  // namespace ls
