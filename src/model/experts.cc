#include "model/experts.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/error.h"
#include "common/parallel.h"
#include "contract.h"
#include "ops/gemm.h"
#include "ops/ops.h"

namespace ls {
namespace {

constexpr int64_t kRowBlock = 64;  // rows per task

// (segment, first row in it) tasks of one round.
std::vector<std::pair<int, int64_t>> row_tasks(const std::vector<Segment>& segs) {
  std::vector<std::pair<int, int64_t>> t;
  for (int s = 0; s < (int)segs.size(); ++s)
    for (int64_t r = 0; r < segs[s].rows; r += kRowBlock) t.push_back({s, r});
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
        if (load[e] > 0) p.round[0].push_back({e, e, 0, load[e], e * busiest});
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
        if (load[e] > 0) p.round[0].push_back({e, e, 0, std::min(load[e], C), e * C});
        p.dropped += std::max<int64_t>(0, load[e] - C);
      }
    }
    return p;
  }
  // rounds: each round every expert has C slots; with borrowing, slots an
  // expert leaves empty go to overflowing experts of its group, lowest first.
  const int g = std::max(1, std::min(c.moe_group_size > 0 ? c.moe_group_size : n, n));
  std::vector<int64_t> done(n, 0), used(n, 0);
  int64_t left = total;
  while (left > 0) {
    if (p.rounds() >= kMaxMoeRounds)
      throw UserError("moe.capacity / moe.capacity_factor: capacity " + std::to_string(C) + " needs more than " +
                      std::to_string(kMaxMoeRounds) + " rounds for the busiest expert's " +
                      std::to_string(busiest) + " rows; raise the capacity");
    std::vector<Segment> segs;
    for (int e = 0; e < n; ++e) {
      used[e] = std::min(load[e] - done[e], C);
      if (used[e] > 0) segs.push_back({e, e, done[e], used[e], e * C});
      done[e] += used[e];
      left -= used[e];
    }
    if (c.moe_borrow)
      for (int g0 = 0; g0 < n; g0 += g) {
        const int g1 = std::min(n, g0 + g);
        int lender = g0;
        for (int e = g0; e < g1; ++e)
          while (done[e] < load[e]) {
            while (lender < g1 && used[lender] == C) ++lender;
            if (lender == g1) break;
            const int64_t take = std::min(load[e] - done[e], C - used[lender]);
            segs.push_back({e, lender, done[e], take, lender * C + used[lender]});
            used[lender] += take;
            done[e] += take;
            left -= take;
            p.borrowed += take;
          }
      }
    // An expert's segments in its row order (own slots first, then lenders').
    std::stable_sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) { return a.expert < b.expert; });
    p.round.push_back(std::move(segs));
  }
  return p;
}

int64_t round_gemm_calls(const RoundPlan& plan, int r, bool) {
  int64_t calls = 0;  // three GEMMs per row block, forward (u, v, y) and backward (dact, dx twice)
  for (const Segment& s : plan.round[r]) calls += 3 * ((s.rows + kRowBlock - 1) / kRowBlock);
  return calls;
}

void experts_round_forward(const RoundPlan& plan, int r, ExpertSlots& slots, ExpertRows& rows, const float* W1,
                           const float* W3, const float* W2, int D, int F) {
  const std::vector<Segment>& segs = plan.round[r];
  const auto tasks = row_tasks(segs);
  parallel_tasks((int64_t)tasks.size(), [&](int64_t t) {
    const Segment& s = segs[tasks[t].first];
    const int64_t b = tasks[t].second, n = std::min(kRowBlock, s.rows - b);
    const int64_t slot = s.slot + b, row = rows.off[s.expert] + s.first + b;
    const int e = s.expert;
    const float *w1 = W1 + (int64_t)e * D * F, *w3 = W3 + (int64_t)e * D * F, *w2 = W2 + (int64_t)e * F * D;
    float *u = &rows.u[row * F], *v = &rows.v[row * F];
    // u = x W1, v = x W3 reduce over the model feature; y = act W2 over the hidden one.
    ops::gemm(n, F, D, {&slots.x[slot * D], D, 1}, {w1, F, 1}, u, F, false, 1);
    ops::gemm(n, F, D, {&slots.x[slot * D], D, 1}, {w3, F, 1}, v, F, false, 1);
    ops::swiglu(u, v, &slots.sg[slot * F], &slots.act[slot * F], n * F);
    ops::gemm(n, D, F, {&slots.act[slot * F], F, 1}, {w2, D, 1}, &slots.y[slot * D], D, false, 1);
  });
}

void experts_round_backward(const RoundPlan& plan, int r, ExpertSlots& slots, const ExpertRows& rows,
                            const float* W1, const float* W3, const float* W2, int D, int F) {
  const std::vector<Segment>& segs = plan.round[r];
  const auto tasks = row_tasks(segs);
  parallel_tasks((int64_t)tasks.size(), [&](int64_t t) {
    const Segment& s = segs[tasks[t].first];
    const int64_t b = tasks[t].second, n = std::min(kRowBlock, s.rows - b);
    const int64_t slot = s.slot + b, row = rows.off[s.expert] + s.first + b;
    const int e = s.expert;
    const float *w1 = W1 + (int64_t)e * D * F, *w3 = W3 + (int64_t)e * D * F, *w2 = W2 + (int64_t)e * F * D;
    const float *u = &rows.u[row * F], *v = &rows.v[row * F];
    float *sg = &slots.sg[slot * F], *act = &slots.act[slot * F], *dact = &slots.dact[slot * F];
    float *du = &slots.du[slot * F], *dv = &slots.dv[slot * F], *dx = &slots.dx[slot * D];
    ops::swiglu(u, v, sg, act, n * F);  // recomputed: elementwise, the forward's bits
    // dact reduces over the model feature; dx over the hidden index of u, then continues over that of v.
    ops::gemm(n, F, D, {&slots.dy[slot * D], D, 1}, {w2, 1, D}, dact, F, false, 1);
    ops::swiglu_backward(u, v, sg, dact, du, dv, n * F);
    ops::gemm(n, D, F, {du, F, 1}, {w1, 1, F}, dx, D, false, 1);
    ops::gemm(n, D, F, {dv, F, 1}, {w3, 1, F}, dx, D, true, 1);
  });
}

void ExpertWeightGrads::begin(const RoundPlan& plan, const ExpertRows& rows, int64_t leaves, int D, int F,
                              std::vector<std::vector<float>>* state) {
  D_ = D;
  F_ = F;
  leaves_ = leaves;
  calls_ = 0;
  const int n = rows.experts();
  segments_.assign(n, 0);
  spanned_.assign(n, 0);
  for (const auto& segs : plan.round) {
    std::vector<uint8_t> seen(n, 0);
    for (const Segment& s : segs) {
      ++segments_[s.expert];
      if (!seen[s.expert]) ++spanned_[s.expert], seen[s.expert] = 1;
    }
  }
  folds_.assign((size_t)n * 3, ops::LeafFold());
  if (state->size() < (size_t)n * 3) state->resize((size_t)n * 3);
  for (int e = 0; e < n; ++e)
    if (spanned_[e] > 1)
      for (int which = 0; which < 3; ++which)
        folds_[(size_t)e * 3 + which].begin(which == 2 ? F : D, which == 2 ? D : F, leaves,
                                            &(*state)[(size_t)e * 3 + which]);
}

void ExpertWeightGrads::add_round(const RoundPlan& plan, int r, const ExpertSlots& slots, const ExpertRows& rows,
                                  float* gW1, float* gW3, float* gW2) {
  const std::vector<Segment>& segs = plan.round[r];
  const int D = D_, F = F_;
  // Tasks: (expert, which gradient); an expert's segments of this round are adjacent, in row order.
  std::vector<std::pair<int, int>> span;  // [first, end) segment of each expert present
  for (int s = 0; s < (int)segs.size();) {
    int t = s;
    while (t < (int)segs.size() && segs[t].expert == segs[s].expert) ++t;
    span.push_back({s, t});
    s = t;
  }
  std::vector<int64_t> counted(span.size() * 3, 0);
  parallel_tasks((int64_t)span.size() * 3, [&](int64_t task) {
    const auto [s0, s1] = span[task / 3];
    const int which = (int)(task % 3), e = segs[s0].expert;
    // W1, W3: X = x rows, dY = du / dv; W2: X = act rows, dY = dy. Each reduces over the expert's token rows.
    const float* X = which == 2 ? slots.act.data() : slots.x.data();
    const float* dY = which == 0 ? slots.du.data() : which == 1 ? slots.dv.data() : slots.dy.data();
    const int in = which == 2 ? F : D, out = which == 2 ? D : F;
    float* dW = (which == 0 ? gW1 : which == 1 ? gW3 : gW2) + (int64_t)e * D * F;
    if (spanned_[e] == 1) {  // all its rows in this round: the register-tile kernel once
      const float *x = X + segs[s0].slot * in, *dy = dY + segs[s0].slot * out;
      const int64_t* leaf = &rows.leaf[rows.off[e] + segs[s0].first];
      int64_t n = segs[s0].rows;
      std::vector<float> gx, gdy;
      if (s1 - s0 > 1) {  // own and lent slots: gather the rows, in row order
        n = 0;
        for (int si = s0; si < s1; ++si) n += segs[si].rows;
        gx.resize(n * in);
        gdy.resize(n * out);
        int64_t at = 0;
        for (int si = s0; si < s1; ++si) {
          const Segment& s = segs[si];
          std::copy(X + s.slot * in, X + (s.slot + s.rows) * in, &gx[at * in]);
          std::copy(dY + s.slot * out, dY + (s.slot + s.rows) * out, &gdy[at * out]);
          at += s.rows;
        }
        x = gx.data();
        dy = gdy.data();
      }
      std::vector<int64_t> off(leaves_ + 1);
      int64_t k = 0;
      for (int64_t lf = 0; lf <= leaves_; ++lf) {
        while (k < n && leaf[k] < lf) ++k;
        off[lf] = k;
      }
      ops::weight_grad(x, in, dy, out, in, out, off.data(), leaves_, dW);
      counted[task] = 1;
      return;
    }
    ops::LeafFold& fold = folds_[(size_t)e * 3 + which];
    for (int si = s0; si < s1; ++si) {
      const Segment& s = segs[si];
      fold.add(X + s.slot * in, in, dY + s.slot * out, out, &rows.leaf[rows.off[e] + s.first], s.rows);
      ++counted[task];
    }
  });
  for (int64_t c : counted) calls_ += c;
}

void ExpertWeightGrads::finish(float* gW1, float* gW3, float* gW2) {
  const int n = (int)segments_.size();
  const int64_t DF = (int64_t)D_ * F_;
  parallel_tasks((int64_t)n * 3, [&](int64_t task) {
    const int e = (int)(task / 3), which = (int)(task % 3);
    float* dW = (which == 0 ? gW1 : which == 1 ? gW3 : gW2) + (int64_t)e * DF;
    if (segments_[e] == 0) std::fill(dW, dW + DF, 0.0f);  // no rows: every leaf +0
    else if (spanned_[e] > 1) folds_[(size_t)e * 3 + which].finish(dW);
  });
}

}  // namespace ls
