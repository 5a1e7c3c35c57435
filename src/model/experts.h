// The routed experts' work on the rank that holds them: rows of tokens
// grouped by expert, each expert's rows in global token order (whatever rank
// or round they came from), so every expert's weight gradient is the
// contract's leaf tree restricted to its tokens. Also the round scheduler,
// which decides when and in which slot a row runs, never its bits.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace ls {

struct ExpertWork {
  int experts = 0;               // experts held here
  std::vector<int64_t> off;      // [experts + 1]: first row of each expert
  std::vector<int64_t> leaf;     // per row: its leaf in the reduction group, ascending per expert
  std::vector<uint8_t> dropped;  // per row: skipped by the `drop` policy (output 0, no gradient)
  std::vector<float> x, u, v, sg, act, y;  // forward: input, SwiGLU parts, output
  std::vector<float> dy, dx, du, dv, dact; // backward
  int64_t rows() const { return off.empty() ? 0 : off.back(); }
};

// What the scheduler decided for one layer on this rank.
struct ScheduleStats {
  int rounds = 0;
  int64_t borrowed = 0;        // rows run in a slot lent by another expert of the group
  int64_t dropped = 0;         // rows skipped (policy drop)
  int64_t peak_rows = 0;       // largest number of rows resident in one round
  int64_t capacity = 0;        // slots per expert per round
};

// Assigns rows to rounds. rounds: capacity C per expert per round, overflow
// waits, borrowing fills unused slots of the same expert group; peak: one
// round sized to the busiest expert; drop: capacity C, overflow dropped (in
// token order). `seen_tokens` is the number of tokens these experts drew
// from (sets C from capacity_factor).
ScheduleStats schedule_experts(const ModelConfig& cfg, ExpertWork& w, int64_t seen_tokens);
// The same decision from the rows per expert alone (marks no rows).
ScheduleStats schedule_loads(const ModelConfig& cfg, const std::vector<int64_t>& load, int64_t seen_tokens);

// Forward/backward of w's rows with the experts' weights W1, W3 [experts, D, F]
// and W2 [experts, F, D]. Rows are independent: threads split rows freely.
void experts_forward(ExpertWork& w, const float* W1, const float* W3, const float* W2, int D, int F);
void experts_backward(ExpertWork& w, const float* W1, const float* W3, const float* W2, int D, int F);
// experts_backward and experts_weight_grads together; on one thread each
// expert's gradients follow its rows' backward while their data are in cache
// (the same bits either way).
void experts_backward_with_weight_grads(ExpertWork& w, const float* W1, const float* W3, const float* W2, int D,
                                        int F, int64_t leaves, float* gW1, float* gW3, float* gW2);
// Weight gradients: per expert, the leaf tree over its rows (leaves
// 0..leaves-1 of the reduction group; empty leaves are +0).
void experts_weight_grads(const ExpertWork& w, int64_t leaves, int D, int F, float* gW1, float* gW3, float* gW2);

}  // namespace ls
