// Shape and MoE settings of the byte-level MoE transformer.
#pragma once

#include <cstdint>

namespace ls {

// How routed tokens are scheduled onto experts (scenario key moe.policy).
enum class MoePolicy {
  kRounds,  // fixed capacity per round; overflow waits for the next round; never drops
  kPeak,    // one round sized to the busiest expert (dropless by reservation)
  kDrop,    // fixed capacity; overflow skips the expert (GShard/Switch); changes the math
};

// Which tokens the load-balancing loss counts over (scenario key moe.aux_scope).
enum class AuxScope {
  kBatch,     // the step's: f_e and P_e over every token of the global batch (Switch)
  kSequence,  // each sample's own f_e and P_e, the samples' losses averaged (DeepSeek-V3's sequence-wise loss)
};

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
  AuxScope aux_scope = AuxScope::kBatch;
  float router_skew = 0.0f;       // fixed logit bonus for experts [0, max(1, E/4)): skewed routing
  MoePolicy moe_policy = MoePolicy::kRounds;
  float capacity_factor = 1.0f;   // slots per expert per round = factor x mean load
  int moe_capacity = 0;           // if > 0: slots per expert per round, overriding the factor
  int moe_group_size = 0;         // experts lending each other slots; 0 = all local experts
  bool moe_borrow = true;         // borrowing of unused slots within a group

  int head_dim() const { return d_model / n_heads; }
};

}  // namespace ls
