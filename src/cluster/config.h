// The simulated cluster's layout (scenario keys mesh.*).
#pragma once

namespace ls {

struct MeshConfig {
  int dp = 1;          // data-parallel ranks (the world): each holds batch/dp consecutive samples
  int ep = 1;          // expert-parallel group size: consecutive ranks sharing the experts
  bool fsdp = false;   // shard parameters, gradients and optimizer state (ZeRO-3 style)
  int replicate = 1;   // with fsdp: replica groups (HSDP); shards span dp/replicate ranks
  int tp = 1;          // tensor-parallel ranks per data-parallel rank (heads and hidden features split)
  bool sp = false;     // sequence parallel: with tp, norms, residuals, router and head on tokens split across tp
  int world() const { return dp * tp; }
};

}  // namespace ls
