// The tiny MoE scenario the mesh, MoE and MPI suites train (a few ms a run):
// 2 layers, 8 experts top-2, 8 samples of 8 bytes, 3 steps. `skewed` adds a
// router bias toward experts 0 and 1, so capacities and rounds matter.
#pragma once

#include <string>

namespace lstest {

inline std::string tiny_scenario(bool skewed = false) {
  return std::string(R"({"model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8, "d_ff": 8},
  "moe": {"experts": 8, "top_k": 2, "aux_loss_weight": 0.05, "z_loss_weight": 0.01)") +
         (skewed ? R"(, "router_skew": 1.0)" : "") + R"(},
  "train": {"steps": 3, "batch": 8, "warmup_steps": 1, "eval_every": 0, "eval_batches": 1},
  "data": {"synthetic_bytes": 8192}})";
}

}  // namespace lstest
