// Shape and MoE settings of the byte-level MoE transformer.
#pragma once

#include <cstdint>

namespace ls {

struct ModelConfig {
  int vocab = 256;          // bytes; fixed
  int d_model = 64;
  int n_layers = 2;
  int n_heads = 4;
  int seq_len = 64;
  int d_ff = 128;           // hidden width of each expert (and the shared expert)
  int experts = 8;
  int top_k = 2;
  bool shared_expert = false;
  float init_std = 0.02f;   // init is uniform with this standard deviation
  float rms_eps = 1e-5f;
  float aux_loss_weight = 0.01f;  // Switch load-balancing loss; 0 disables
  float z_loss_weight = 0.001f;   // router z-loss; 0 disables

  int head_dim() const { return d_model / n_heads; }
};

}  // namespace ls
