// The routed experts' work on the rank that holds them, run in rounds of
// fixed-capacity slots (docs/MOE.md). Every expert's rows are in global
// token order (whatever rank they came from); a round hands each expert its
// next rows, in that order, in its own slots and, with borrowing, in slots
// other experts of its group leave empty. Rounds and slots decide where and
// when a row is computed, never its bits: each row's math is independent of
// the others, and the weight-gradient leaf trees continue across rounds.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "ops/leaf_fold.h"

namespace ls {

// Rounds past this are refused (a capacity that can never make progress in
// reasonable time): UserError naming moe.capacity / moe.capacity_factor.
constexpr int kMaxMoeRounds = 4096;

// Rows first .. first + rows - 1 of `expert` (in its token order) computed
// in slots slot .. slot + rows - 1, which belong to expert `lender` (the
// expert itself, or a group mate that lent them).
struct Segment {
  int expert = 0, lender = 0;
  int64_t first = 0, rows = 0, slot = 0;
};

// What the scheduler decided for one layer's experts on their owner.
struct RoundPlan {
  int64_t capacity = 0;                     // slots per expert
  int64_t slots = 0;                        // capacity x experts: the working buffers' rows
  std::vector<std::vector<Segment>> round;  // per round; an expert's segments in its row order
  std::vector<int64_t> load;                // rows per expert
  int64_t borrowed = 0;                     // rows computed in a lender's slots
  int64_t dropped = 0;                      // rows skipped (policy drop)
  int rounds() const { return (int)round.size(); }
};

// Slots per expert per round from moe.capacity or moe.capacity_factor;
// `seen_tokens` is the number of tokens the experts drew from.
int64_t round_capacity(const ModelConfig& cfg, int64_t seen_tokens);
// rounds: capacity C per expert per round, overflow waits, borrowing fills
// empty slots of the same group (lowest borrower first, lowest lender
// first); peak: one round with every expert's slots sized to the busiest
// expert; drop: one round of C slots, overflow skipped.
RoundPlan plan_rounds(const ModelConfig& cfg, const std::vector<int64_t>& load, int64_t seen_tokens);

// The capacity-sized working rows, reused by every round and layer.
struct ExpertSlots {
  std::vector<float> x, sg, act, y;         // forward: input rows, SwiGLU gate and product, output rows
  std::vector<float> dy, dact, du, dv, dx;  // backward
};

// What the owner keeps per routed row between forward and backward (no
// padding): the SwiGLU inputs u and v (sg and act are recomputed from them),
// and, with expert parallelism, the input row itself.
struct ExpertRows {
  std::vector<int64_t> off;   // [experts + 1]: first row of each expert
  std::vector<int64_t> leaf;  // per row: its leaf in the reduction group, ascending per expert
  std::vector<float> x;       // [rows, D] (expert parallel only)
  std::vector<float> u, v;    // [rows, F]
  int experts() const { return (int)off.size() - 1; }
};

// The GEMM calls one round's segments cost (forward or backward, without
// the weight gradients).
int64_t round_gemm_calls(const RoundPlan& plan, int r, bool backward);

// Round r forward with the experts' weights W1, W3 [experts, D, F] and W2
// [experts, F, D]: slots.x -> rows.u, rows.v, slots.y. Each segment runs
// with its expert's weights (a grouped GEMM). Rows are independent.
void experts_round_forward(const RoundPlan& plan, int r, ExpertSlots& slots, ExpertRows& rows, const float* W1,
                           const float* W3, const float* W2, int D, int F);
// Round r backward: slots.dy (and slots.x) -> slots.dx; du, dv and act stay
// in the slots for the weight gradients.
void experts_round_backward(const RoundPlan& plan, int r, ExpertSlots& slots, const ExpertRows& rows,
                            const float* W1, const float* W3, const float* W2, int D, int F);

// The experts' weight gradients, fed round by round: per expert the leaf
// tree over its rows (leaves 0..leaves-1 of the reduction group; empty
// leaves are +0), whichever round or slot computed each row. An expert
// whose rows all run in one round uses ops::weight_grad on them (gathered
// from its own and lent slots if it has several segments); the others fold
// into ops::LeafFold state that persists across rounds.
class ExpertWeightGrads {
 public:
  void begin(const RoundPlan& plan, const ExpertRows& rows, int64_t leaves, int D, int F,
             std::vector<std::vector<float>>* state);
  // After experts_round_backward(plan, r, ...).
  void add_round(const RoundPlan& plan, int r, const ExpertSlots& slots, const ExpertRows& rows, float* gW1,
                 float* gW3, float* gW2);
  // After the last round; `calls` counts the gradient GEMM calls made.
  void finish(float* gW1, float* gW3, float* gW2);
  int64_t calls() const { return calls_; }

 private:
  int D_ = 0, F_ = 0;
  int64_t leaves_ = 0, calls_ = 0;
  std::vector<int> segments_;          // per expert: segments over all rounds
  std::vector<int> spanned_;           // per expert: rounds it has rows in
  std::vector<ops::LeafFold> folds_;   // per expert x {W1, W3, W2}, for experts of several segments
};

}  // namespace ls
