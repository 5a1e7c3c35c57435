#include "model/experts.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <string>

#include "common/error.h"
#include "common/parallel.h"
#include "contract.h"
#include "ops/gemm.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace ls {
namespace {

constexpr int64_t kRowBlock = 64;  // rows per task

// Rows per GEMM call: blocks that threads share, or, on one thread, whole
// segments (each call packs its expert's weights, transposed in the backward).
// A kernel backend takes whole segments too: one launch each, the GPU's
// threads share it (a GEMM's outputs do not depend on how rows are split).
int64_t row_block() { return run_inline(2) || ops::installed_kernels() ? INT64_MAX / 4 : kRowBlock; }

// (segment, first row in it) tasks of one round.
std::vector<std::pair<int, int64_t>> row_tasks(const std::vector<Segment>& segs, int64_t block) {
  std::vector<std::pair<int, int64_t>> t;
  for (int s = 0; s < (int)segs.size(); ++s)
    for (int64_t r = 0; r < segs[s].rows; r += block) t.push_back({s, r});
  return t;
}

}  // namespace

int64_t round_capacity(const ModelConfig& c, int64_t seen_tokens) {
  const int64_t C = c.moe_capacity > 0
                        ? c.moe_capacity
                        : (int64_t)std::ceil(c.capacity_factor * (double)seen_tokens * c.top_k / c.experts);
  return std::max<int64_t>(C, 1);
}

RoundPlan plan_rounds(const ModelConfig& c, const std::vector<int64_t>& load, int64_t seen_tokens) {
  RoundPlan p;
  p.load = load;
  const int n = (int)load.size();
  int64_t busiest = 0, total = 0;
  for (int64_t l : load) {
    busiest = std::max(busiest, l);
    total += l;
  }
  if (c.moe_policy == MoePolicy::kPeak) {  // every expert reserves the busiest expert's rows
    p.capacity = busiest;
    p.slots = busiest * n;
    if (total > 0) {
      p.round.emplace_back();
      for (int e = 0; e < n; ++e)
        if (load[e] > 0) p.round[0].push_back({e, 0, load[e], e * busiest});
    }
    return p;
  }
  const int64_t C = round_capacity(c, seen_tokens);
  p.capacity = C;
  p.slots = C * n;
  if (c.moe_policy == MoePolicy::kDrop) {  // rows past the capacity, in token order, are skipped
    if (total > 0) {
      p.round.emplace_back();
      for (int e = 0; e < n; ++e) {
        if (load[e] > 0) p.round[0].push_back({e, 0, std::min(load[e], C), e * C});
        p.dropped += std::max<int64_t>(0, load[e] - C);
      }
    }
    return p;
  }
  // rounds: each round every expert has C slots; with borrowing, slots an
  // expert leaves empty go to overflowing experts of its group, lowest
  // first. A group's experts then lie side by side in the group's slots, in
  // expert order, so each expert is one segment per round.
  const int g = std::max(1, std::min(c.moe_group_size > 0 ? c.moe_group_size : n, n));
  std::vector<int64_t> done(n, 0), take(n, 0);
  int64_t left = total;
  while (left > 0) {
    if (p.rounds() >= kMaxMoeRounds)
      throw UserError("moe.capacity / moe.capacity_factor: capacity " + std::to_string(C) + " needs more than " +
                      std::to_string(kMaxMoeRounds) + " rounds for the busiest expert's " +
                      std::to_string(busiest) + " rows; raise the capacity");
    std::vector<Segment> segs;
    for (int g0 = 0; g0 < n; g0 += g) {
      const int g1 = std::min(n, g0 + g);
      int64_t spare = 0;
      for (int e = g0; e < g1; ++e) {
        take[e] = std::min(load[e] - done[e], C);
        spare += C - take[e];
      }
      if (c.moe_borrow)
        for (int e = g0; e < g1 && spare > 0; ++e) {
          const int64_t more = std::min(load[e] - done[e] - take[e], spare);
          take[e] += more;
          spare -= more;
          p.borrowed += more;
        }
      int64_t slot = (int64_t)g0 * C;
      for (int e = g0; e < g1; ++e) {
        if (take[e] > 0) segs.push_back({e, done[e], take[e], slot});
        slot += take[e];
        done[e] += take[e];
        left -= take[e];
      }
    }
    p.round.push_back(std::move(segs));
  }
  return p;
}

namespace {

// Runs fn(segment, its first row b in the block, rows n, slot, row of u, v
// and sg (the experts' row order, from rows.hidden_base), W1, W3, W2 of the
// segment's expert) for every row block of round r, blocks in parallel;
// returns the tasks run.
template <class Fn>
int64_t for_each_block(const std::vector<Segment>& segs, const ExpertRows& rows, const float* W1, const float* W3,
                       const float* W2, int D, int F, Fn&& fn) {
  const int64_t block = row_block();
  const auto tasks = row_tasks(segs, block);
  parallel_tasks((int64_t)tasks.size(), [&](int64_t t) {
    const Segment& s = segs[tasks[t].first];
    const int64_t b = tasks[t].second, n = std::min(block, s.rows - b);
    const int64_t e = s.expert;
    const int64_t per_expert = (int64_t)D * F;  // a part passes nullptr for the weights it does not read
    fn(s, b, n, s.slot + b, rows.off[e] + s.first + b - rows.hidden_base, W1 ? W1 + e * per_expert : nullptr,
       W3 ? W3 + e * per_expert : nullptr, W2 ? W2 + e * per_expert : nullptr);
  });
  return (int64_t)tasks.size();
}

}  // namespace

int64_t experts_round_hidden(const RoundPlan& plan, int r, ExpertSlots& slots, ExpertRows& rows, const float* W1,
                             const float* W3, int D, int F) {
  const int64_t tasks = for_each_block(plan.round[r], rows, W1, W3, nullptr, D, F,
                                       [&](const Segment&, int64_t, int64_t n, int64_t slot, int64_t row,
                                           const float* w1, const float* w3, const float*) {
    float *u = &rows.u[row * F], *v = &rows.v[row * F];
    ops::matmul(n, F, D, {&slots.x[slot * D], D, 1}, {w1, F, 1}, u, F, false, 1);
    ops::matmul(n, F, D, {&slots.x[slot * D], D, 1}, {w3, F, 1}, v, F, false, 1);
    ops::swiglu(u, v, &rows.sg[row * F], &slots.act[slots.hidden(slot) * F], n * F);
  });
  return 2 * tasks;  // GEMM calls: u, v per task
}

int64_t experts_round_output(const std::vector<Segment>& segs, const ExpertSlots& slots, const ExpertRows& rows,
                             RowPlace y, const float* W2, int D, int F, bool accumulate) {
  return for_each_block(segs, rows, nullptr, nullptr, W2, D, F,
                        [&](const Segment& s, int64_t b, int64_t n, int64_t slot, int64_t, const float*, const float*,
                            const float* w2) {
    ops::matmul(n, D, F, {&slots.act[slots.hidden(slot) * F], F, 1}, {w2, D, 1}, y.at(rows, s, b, D), D, accumulate, 1);
  });
}

int64_t experts_round_backward_hidden(const RoundPlan& plan, int r, ExpertSlots& slots, const ExpertRows& rows,
                                      RowPlace dy, const float* W2, int D, int F) {
  return for_each_block(plan.round[r], rows, nullptr, nullptr, W2, D, F,
                        [&](const Segment& s, int64_t b, int64_t n, int64_t slot, int64_t row, const float*,
                            const float*, const float* w2) {
    const float *u = &rows.u[row * F], *v = &rows.v[row * F], *sg = &rows.sg[row * F];
    const int64_t h = slots.hidden(slot);
    float *act = &slots.act[h * F], *dact = &slots.dact[h * F];
    ops::swiglu_product(u, sg, v, act, n * F);  // the forward's act, for W2's gradient
    ops::matmul(n, F, D, {dy.at(rows, s, b, D), D, 1}, {w2, 1, D}, dact, F, false, 1);
    ops::swiglu_backward(u, v, sg, dact, &slots.du[h * F], &slots.dv[h * F], n * F);
  });
}

int64_t experts_round_input_grad(const std::vector<Segment>& segs, const ExpertSlots& slots, const ExpertRows& rows,
                                 RowPlace dx, const float* W1, const float* W3, int D, int F, int first_pass, int count,
                                 bool accumulate) {
  const int64_t tasks = for_each_block(segs, rows, W1, W3, nullptr, D, F,
                                       [&](const Segment& s, int64_t b, int64_t n, int64_t slot, int64_t,
                                           const float* w1, const float* w3, const float*) {
    float* dxr = dx.at(rows, s, b, D);
    for (int pass = first_pass; pass < first_pass + count; ++pass) {
      const float* dhidden = pass == 0 ? &slots.du[slots.hidden(slot) * F] : &slots.dv[slots.hidden(slot) * F];
      ops::matmul(n, D, F, {dhidden, F, 1}, {pass == 0 ? w1 : w3, 1, F}, dxr, D, accumulate || pass > first_pass, 1);
    }
  });
  return count * tasks;
}

SlotRange hidden_slot_range(const RoundPlan& plan) {
  SlotRange r{INT64_MAX, 0};
  for (const std::vector<Segment>& round : plan.round)
    for (const Segment& s : round) {
      r.first = std::min(r.first, s.slot);
      r.end = std::max(r.end, s.slot + s.rows);
    }
  return r.first < r.end ? r : SlotRange{};
}

int64_t segment_rows(const std::vector<Segment>& segs) {
  int64_t n = 0;
  for (const Segment& s : segs) n += s.rows;
  return n;
}

std::vector<std::vector<Segment>> cut_segments(const std::vector<Segment>& segs, int pieces) {
  const int64_t total = segment_rows(segs), P = std::max(1, pieces);
  std::vector<std::vector<Segment>> out((size_t)P);
  auto end_of = [&](int64_t piece) { return total * (piece + 1) / P; };  // rows before piece + 1
  int64_t done = 0, piece = 0;  // rows placed so far; the piece they go to
  for (Segment s : segs)
    while (s.rows > 0) {
      while (done >= end_of(piece)) ++piece;
      const int64_t n = std::min(s.rows, end_of(piece) - done);
      out[(size_t)piece].push_back({s.expert, s.first, n, s.slot});
      s.first += n, s.slot += n, s.rows -= n, done += n;
    }
  return out;
}

void pack_rows(const std::vector<Segment>& segs, const ExpertRows& rows, RowPlace place, int width, float* buffer) {
  ops::synchronize();
  for (const Segment& s : segs) {
    std::copy(place.at(rows, s, 0, width), place.at(rows, s, s.rows, width), buffer);
    buffer += s.rows * width;
  }
}

void unpack_rows(const std::vector<Segment>& segs, const ExpertRows& rows, RowPlace place, int width,
                 const float* buffer) {
  for (const Segment& s : segs) {
    std::copy(buffer, buffer + s.rows * width, place.at(rows, s, 0, width));
    buffer += s.rows * width;
  }
}

void ExpertWeightGrads::begin(const RoundPlan& plan, const ExpertRows& rows, int64_t leaves, int D, int F,
                              std::vector<ops::DeviceVector<float>>* state) {
  D_ = D;
  F_ = F;
  leaves_ = leaves;
  calls_ = 0;
  const int n = rows.experts();
  segments_.assign(n, 0);
  for (const auto& segs : plan.round)
    for (const Segment& s : segs) ++segments_[s.expert];  // one per round it has rows in
  folds_.assign((size_t)n * 3, ops::LeafFold());
  if (state->size() < (size_t)n * 3) state->resize((size_t)n * 3);
  for (int e = 0; e < n; ++e)
    if (segments_[e] > 1)
      for (int which = 0; which < 3; ++which)
        folds_[(size_t)e * 3 + which].begin(which == 2 ? F : D, which == 2 ? D : F, leaves,
                                            &(*state)[(size_t)e * 3 + which]);
}

void ExpertWeightGrads::add_round(const RoundPlan& plan, int r, const ExpertSlots& slots, const ExpertRows& rows,
                                  RowPlace dy, float* gW1, float* gW3, float* gW2) {
  const std::vector<Segment>& segs = plan.round[r];
  const int D = D_, F = F_;
  // The last round's kernels may still read the leaf offsets rewritten below.
  ops::synchronize();
  if (leaf_offsets_.size() < segs.size() * 3) leaf_offsets_.resize(segs.size() * 3);
  // Tasks: (segment, which gradient); an expert has one segment per round.
  parallel_tasks((int64_t)segs.size() * 3, [&](int64_t task) {
    const Segment& s = segs[task / 3];
    const int which = (int)(task % 3), e = s.expert;
    // W1, W3: X = x rows, dY = du / dv; W2: X = act rows, dY = dy. Each reduces over the expert's token rows.
    const int in = which == 2 ? F : D, out = which == 2 ? D : F;
    const float* X = which == 2 ? slots.act.data() + slots.hidden(s.slot) * in : slots.x.data() + s.slot * in;
    const float* dY = which == 2 ? dy.at(rows, s, 0, D)
                                 : (which == 0 ? slots.du.data() : slots.dv.data()) + slots.hidden(s.slot) * out;
    const int64_t* leaf = &rows.leaf[rows.off[e] + s.first];
    if (segments_[e] > 1) {  // rows in several rounds: the fold continues
      folds_[(size_t)e * 3 + which].add(X, in, dY, out, leaf, s.rows);
      return;
    }
    // All its rows in this one segment: the register-tile kernel once.
    ops::DeviceVector<int64_t>& off = leaf_offsets_[task];  // read by the kernel: kept until the next round
    off.resize(leaves_ + 1);
    int64_t k = 0;
    for (int64_t lf = 0; lf <= leaves_; ++lf) {
      while (k < s.rows && leaf[k] < lf) ++k;
      off[lf] = k;
    }
    ops::weight_grad(X, in, dY, out, in, out, off.data(), leaves_, (which == 0 ? gW1 : which == 1 ? gW3 : gW2) + (int64_t)e * D * F);
  });
  calls_ += 3 * (int64_t)segs.size();
}

void ExpertWeightGrads::finish(float* gW1, float* gW3, float* gW2) {
  const int n = (int)segments_.size();
  const int64_t DF = (int64_t)D_ * F_;
  parallel_tasks((int64_t)n * 3, [&](int64_t task) {
    const int e = (int)(task / 3), which = (int)(task % 3);
    float* dW = (which == 0 ? gW1 : which == 1 ? gW3 : gW2) + (int64_t)e * DF;
    if (segments_[e] == 0) ops::fill(dW, DF, 0.0f);  // no rows: every leaf +0
    else if (segments_[e] > 1) folds_[(size_t)e * 3 + which].finish(dW);
  });
}

void ExpertGradsBySource::begin(int experts, int sources, int64_t leaves, int D, int F) {
  D_ = D;
  F_ = F;
  sources_ = sources;
  leaves_ = leaves;
  calls_ = 0;
  const size_t n = (size_t)experts * 3 * sources;
  folds_.assign(n, ops::LeafFold());
  if (state_.size() < n) state_.resize(n);
  for (size_t f = 0; f < n; ++f) {
    const int which = (int)(f / sources % 3);
    folds_[f].begin(which == 2 ? F : D, which == 2 ? D : F, leaves, &state_[f]);
  }
}

void ExpertGradsBySource::add_round(const RoundPlan& plan, int r, const ExpertSlots& slots, const ExpertRows& rows,
                                    RowPlace dy) {
  const std::vector<Segment>& segs = plan.round[r];
  const int D = D_, F = F_;
  std::vector<int64_t> calls(segs.size() * 3, 0);
  parallel_tasks((int64_t)segs.size() * 3, [&](int64_t task) {
    const Segment& s = segs[task / 3];
    const int which = (int)(task % 3), e = s.expert;
    const int in = which == 2 ? F : D, out = which == 2 ? D : F;
    const float* X = which == 2 ? slots.act.data() + slots.hidden(s.slot) * in : slots.x.data() + s.slot * in;
    const int64_t* leaf = &rows.leaf[rows.off[e] + s.first];
    std::vector<int64_t> within((size_t)s.rows);
    // The segment's rows, source by source (rows are in source, then token order).
    for (int64_t k0 = 0; k0 < s.rows;) {
      const int64_t src = leaf[k0] / leaves_;
      int64_t k1 = k0;
      for (; k1 < s.rows && leaf[k1] / leaves_ == src; ++k1) within[(size_t)k1] = leaf[k1] - src * leaves_;
      const float* dY = which == 2 ? dy.at(rows, s, k0, D)
                                   : (which == 0 ? slots.du.data() : slots.dv.data()) + slots.hidden(s.slot + k0) * out;
      folds_[((size_t)e * 3 + which) * sources_ + (size_t)src].add(X + k0 * in, in, dY, out, &within[(size_t)k0], k1 - k0);
      ++calls[(size_t)task];
      k0 = k1;
    }
  });
  for (int64_t c : calls) calls_ += c;
}

void ExpertGradsBySource::finish(float* gW1, float* gW3, float* gW2) {
  const int64_t DF = (int64_t)D_ * F_;
  const int experts = (int)(folds_.size() / 3 / sources_);
  if (source_tree_.size() < (size_t)experts * 3) source_tree_.resize((size_t)experts * 3);
  parallel_tasks((int64_t)experts * 3, [&](int64_t task) {
    const int e = (int)(task / 3), which = (int)(task % 3);
    ops::DeviceVector<float>& scratch = source_tree_[(size_t)task];
    scratch.resize((size_t)LeafTree::levels_for(sources_) * DF);
    LeafTree tree(scratch.data(), DF);
    auto merge = [&](int d) { ops::add(tree.slots + d * DF, tree.slots + (d + 1) * DF, tree.slots + d * DF, DF); };
    for (int src = 0; src < sources_; ++src) {
      folds_[((size_t)e * 3 + which) * sources_ + src].finish(tree.next_leaf());
      tree.push_with(merge);
    }
    tree.finish_with(merge);
    ops::copy_rows(tree.slots, nullptr, (which == 0 ? gW1 : which == 1 ? gW3 : gW2) + e * DF, nullptr, 1, DF);
  });
}

int64_t ExpertGradsBySource::state_bytes() const {
  int64_t n = 0;
  for (const auto& v : state_) n += (int64_t)(v.capacity() * sizeof(float));
  for (const auto& v : source_tree_) n += (int64_t)(v.capacity() * sizeof(float));
  return n;
}

}  // namespace ls
