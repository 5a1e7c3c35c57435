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

#include "ops/device_memory.h"

#include "model/config.h"
#include "ops/leaf_fold.h"

namespace ls {

// Rounds past this are refused (a capacity that can never make progress in
// reasonable time): UserError naming moe.capacity / moe.capacity_factor.
constexpr int kMaxMoeRounds = 4096;

// Rows first .. first + rows - 1 of `expert` (in its token order) computed
// in slots slot .. slot + rows - 1 of its group's slots (rows past the
// expert's capacity use slots its group mates left empty).
struct Segment {
  int expert = 0;
  int64_t first = 0, rows = 0, slot = 0;
};

// What the scheduler decided for one layer's experts on their owner.
struct RoundPlan {
  int64_t capacity = 0;                     // slots per expert
  int64_t slots = 0;                        // capacity x experts: the working buffers' rows
  std::vector<std::vector<Segment>> round;  // per round; an expert's segments in its row order
  std::vector<int64_t> load;                // rows per expert
  int64_t borrowed = 0;                     // rows past their expert's capacity, in lent slots
  int64_t dropped = 0;                      // rows skipped (policy drop)
  int rounds() const { return (int)round.size(); }
};

// Slots per expert per round from moe.capacity or moe.capacity_factor;
// `seen_tokens` is the number of tokens the experts drew from.
int64_t round_capacity(const ModelConfig& cfg, int64_t seen_tokens);
// rounds: capacity C per expert per round, overflow waits, borrowing fills
// empty slots of the same group (lowest borrower first); a group's experts
// lie side by side in its C x group slots, one segment each per round.
// peak: one round with every expert's slots sized to the busiest expert;
// drop: one round of C slots, overflow skipped.
RoundPlan plan_rounds(const ModelConfig& cfg, const std::vector<int64_t>& load, int64_t seen_tokens);

// The capacity-sized working rows, reused by every round and layer.
struct ExpertSlots {
  ops::DeviceVector<float> x, act, y;             // forward: input rows, SwiGLU product, output rows
  ops::DeviceVector<float> dy, dact, du, dv, dx;  // backward
  // The first slot the d_ff-wide buffers (act, dact, du, dv) hold: 0, or
  // for a context-parallel rank the lowest slot its block of experts uses
  // (hidden_slot_range), so it holds them for that block only.
  int64_t hidden_base = 0;
  int64_t hidden(int64_t slot) const { return slot - hidden_base; }
};

// [first, end) of the slots a plan's segments use, over every round.
struct SlotRange {
  int64_t first = 0, end = 0;
};
SlotRange hidden_slot_range(const RoundPlan& plan);

// What the owner keeps per routed row between forward and backward (no
// padding): the SwiGLU inputs u, v and gate sg (act is recomputed from
// them, two multiplies per element), and, with expert parallelism, the
// input row itself.
struct ExpertRows {
  std::vector<int64_t> off;   // [experts + 1]: first row of each expert
  std::vector<int64_t> leaf;  // per row: its leaf in the reduction group, ascending per expert
  ops::DeviceVector<float> x;       // [rows, D] (expert parallel only)
  ops::DeviceVector<float> u, v, sg;  // [rows, F] from row hidden_base on
  // The first row u, v and sg hold: 0, or with context parallel the first
  // row of the rank's expert block (the only rows it computes).
  int64_t hidden_base = 0;
  int experts() const { return (int)off.size() - 1; }
};

// Where a round reads or writes rows of `width` floats: in the slots (row
// = the segment's slot), or in a buffer in the experts' row order (row =
// off[expert] + first), which without expert parallelism is the dispatch
// order itself, so outputs land where the combine reads them.
struct RowPlace {
  float* base = nullptr;
  bool by_slot = true;
  float* at(const ExpertRows& rows, const Segment& s, int64_t b, int width) const {
    return base + (by_slot ? s.slot + b : rows.off[s.expert] + s.first + b) * width;
  }
};

// Round r forward with the experts' weights W1, W3 [experts, D, F] and W2
// [experts, F, D] (F: the hidden features held; tensor parallel holds a
// range of them), in two parts. Each segment runs with its expert's weights
// (a grouped GEMM); rows are independent. Each returns the GEMM calls made.
// The hidden part: slots.x -> rows.u, v, sg and slots.act; u = x W1 and
// v = x W3 reduce over the model feature.
int64_t experts_round_hidden(const RoundPlan& plan, int r, ExpertSlots& slots, ExpertRows& rows, const float* W1,
                             const float* W3, int D, int F);
// The output part: y (+)= slots.act W2, reducing over the hidden feature;
// with accumulate each output's fold continues (tensor parallel chains it).
int64_t experts_round_output(const std::vector<Segment>& segs, const ExpertSlots& slots, const ExpertRows& rows,
                             RowPlace y, const float* W2, int D, int F, bool accumulate);
// Round r backward, in two parts. The hidden part: dy (and rows.u, v, sg)
// -> slots.act (the forward's, for W2's gradient), dact, du and dv; dact
// reduces over the model feature.
int64_t experts_round_backward_hidden(const RoundPlan& plan, int r, ExpertSlots& slots, const ExpertRows& rows,
                                      RowPlace dy, const float* W2, int D, int F);
// The input gradient: dx (+)= du W1^T (pass 0), then dv W3^T (pass 1), for
// passes first_pass .. first_pass + count - 1: one fold over the hidden
// index of u, continuing over that of v; with accumulate the first pass
// continues dx's fold.
int64_t experts_round_input_grad(const std::vector<Segment>& segs, const ExpertSlots& slots, const ExpertRows& rows,
                                 RowPlace dx, const float* W1, const float* W3, int D, int F, int first_pass, int count,
                                 bool accumulate);
// (The output part and the input gradient run on `segs`: a round's segments
// (plan.round[r]) or a piece of them (cut_segments); rows are independent.)

// Rows in segs.
int64_t segment_rows(const std::vector<Segment>& segs);
// segs cut into `pieces` consecutive pieces of near-equal rows, a segment
// split where a piece ends (its first rows in one piece, the rest in the
// next): what a pipelined chain hands on piece by piece.
std::vector<std::vector<Segment>> cut_segments(const std::vector<Segment>& segs, int pieces);
// The rows of segs at `place` (width floats each), in segment order,
// packed into `buffer` or unpacked from it: what a chained fold hands on.
void pack_rows(const std::vector<Segment>& segs, const ExpertRows& rows, RowPlace place, int width, float* buffer);
void unpack_rows(const std::vector<Segment>& segs, const ExpertRows& rows, RowPlace place, int width,
                 const float* buffer);

// The experts' weight gradients, fed round by round: per expert the leaf
// tree over its rows (leaves 0..leaves-1 of the reduction group; empty
// leaves are +0), whichever round or slot computed each row. An expert
// whose rows all run in one round (one segment) uses ops::weight_grad on
// its slots; the others fold into ops::LeafFold state that persists across
// rounds.
class ExpertWeightGrads {
 public:
  void begin(const RoundPlan& plan, const ExpertRows& rows, int64_t leaves, int D, int F,
             std::vector<ops::DeviceVector<float>>* state);
  // After experts_round_backward(plan, r, ...).
  void add_round(const RoundPlan& plan, int r, const ExpertSlots& slots, const ExpertRows& rows, RowPlace dy,
                 float* gW1, float* gW3, float* gW2);
  // After the last round; `calls` counts the gradient GEMM calls made.
  void finish(float* gW1, float* gW3, float* gW2);
  int64_t calls() const { return calls_; }

 private:
  int D_ = 0, F_ = 0;
  int64_t leaves_ = 0, calls_ = 0;
  std::vector<int> segments_;          // per expert: segments over all rounds (one per round it has rows in)
  std::vector<ops::LeafFold> folds_;   // per expert x {W1, W3, W2}, for experts of several segments
  std::vector<ops::DeviceVector<int64_t>> leaf_offsets_;  // per task of a round: its leaf offsets, read by the kernel
};

// Expert parallel in a pipeline of several microbatches: a source rank's
// rows of one microbatch are not next to its rows of the next in the
// group's leaf order, so the owner keeps one leaf tree per (expert,
// gradient, source rank) over that source's whole step, continued
// microbatch after microbatch (leaves of a source's later microbatches
// come later), and at the end takes the tree over sources: the canonical
// tree over the group's leaves, as one pass computes it. Row leaf ids are
// source * leaves + the leaf within the source's step.
class ExpertGradsBySource {
 public:
  // At the step's first microbatch. leaves: per source rank, over the whole step.
  void begin(int experts, int sources, int64_t leaves, int D, int F);
  // After experts_round_backward(plan, r, ...) of any microbatch.
  void add_round(const RoundPlan& plan, int r, const ExpertSlots& slots, const ExpertRows& rows, RowPlace dy);
  // After the step's last microbatch: the gradients.
  void finish(float* gW1, float* gW3, float* gW2);
  int64_t calls() const { return calls_; }
  int64_t state_bytes() const;  // measured: the trees' allocated state

 private:
  int D_ = 0, F_ = 0, sources_ = 1;
  int64_t leaves_ = 0, calls_ = 0;
  std::vector<ops::LeafFold> folds_;  // [(expert * 3 + which) * sources + source]
  std::vector<ops::DeviceVector<float>> state_;
  std::vector<ops::DeviceVector<float>> source_tree_;  // per (expert, which): the tree over sources at finish
};

}  // namespace ls
