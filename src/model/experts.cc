#include "model/experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/parallel.h"
#include "contract.h"
#include "ops/gemm.h"
#include "ops/ops.h"

namespace ls {
namespace {

constexpr int64_t kRowBlock = 64;  // rows per task

// (expert, first row) tasks over all rows.
std::vector<std::pair<int, int64_t>> row_tasks(const ExpertWork& w) {
  std::vector<std::pair<int, int64_t>> t;
  for (int e = 0; e < w.experts; ++e)
    for (int64_t r = w.off[e]; r < w.off[e + 1]; r += kRowBlock) t.push_back({e, r});
  return t;
}

}  // namespace

ScheduleStats schedule_loads(const ModelConfig& c, const std::vector<int64_t>& load, int64_t seen_tokens) {
  ScheduleStats st;
  const int n = (int)load.size();
  int64_t busiest = 0;
  for (int64_t l : load) busiest = std::max(busiest, l);
  int64_t C = c.moe_capacity > 0 ? c.moe_capacity
                                 : (int64_t)std::ceil(c.capacity_factor * (double)seen_tokens * c.top_k / c.experts);
  C = std::max<int64_t>(C, 1);
  if (c.moe_policy == MoePolicy::kPeak) {
    st.capacity = busiest;
    st.rounds = busiest > 0 ? 1 : 0;
    st.peak_rows = busiest * n;  // reserved: every expert sized to the busiest
    return st;
  }
  st.capacity = C;
  if (c.moe_policy == MoePolicy::kDrop) {
    st.rounds = busiest > 0 ? 1 : 0;
    for (int64_t l : load) st.dropped += std::max<int64_t>(0, l - C);
    st.peak_rows = C * n;
    return st;
  }
  // rounds: each round every expert has C slots; with borrowing, slots an
  // expert leaves empty go to overflowing experts of its group, lowest first.
  std::vector<int64_t> left = load;
  const int g = std::max(1, std::min(c.moe_group_size > 0 ? c.moe_group_size : n, n));
  int64_t remaining = 0;
  for (int64_t l : left) remaining += l;
  while (remaining > 0) {
    ++st.rounds;
    int64_t resident = 0;
    for (int g0 = 0; g0 < n; g0 += g) {
      const int g1 = std::min(n, g0 + g);
      int64_t spare = 0;
      for (int e = g0; e < g1; ++e) {
        const int64_t take = std::min(left[e], C);
        left[e] -= take;
        spare += C - take;
        resident += take;
      }
      if (c.moe_borrow)
        for (int e = g0; e < g1 && spare > 0; ++e) {
          const int64_t take = std::min(left[e], spare);
          left[e] -= take;
          spare -= take;
          st.borrowed += take;
          resident += take;
        }
    }
    remaining = 0;
    for (int64_t l : left) remaining += l;
    st.peak_rows = std::max(st.peak_rows, std::max(resident, C * n));
  }
  return st;
}

ScheduleStats schedule_experts(const ModelConfig& c, ExpertWork& w, int64_t seen_tokens) {
  std::vector<int64_t> load(w.experts);
  for (int e = 0; e < w.experts; ++e) load[e] = w.off[e + 1] - w.off[e];
  const ScheduleStats st = schedule_loads(c, load, seen_tokens);
  w.dropped.assign(w.rows(), 0);
  if (c.moe_policy == MoePolicy::kDrop)  // rows past the capacity, in token order
    for (int e = 0; e < w.experts; ++e)
      for (int64_t r = w.off[e] + st.capacity; r < w.off[e + 1]; ++r) w.dropped[r] = 1;
  return st;
}

void experts_forward(ExpertWork& w, const float* W1, const float* W3, const float* W2, int D, int F) {
  const int64_t R = w.rows();
  w.u.resize(R * F);
  w.v.resize(R * F);
  w.sg.resize(R * F);
  w.act.resize(R * F);
  w.y.resize(R * D);
  const auto tasks = row_tasks(w);
  parallel_tasks((int64_t)tasks.size(), [&](int64_t t) {
    const int e = tasks[t].first;
    const int64_t r0 = tasks[t].second, rows = std::min(kRowBlock, w.off[e + 1] - r0);
    const float *w1 = W1 + (int64_t)e * D * F, *w3 = W3 + (int64_t)e * D * F, *w2 = W2 + (int64_t)e * F * D;
    // u = x W1, v = x W3 reduce over the model feature; y = act W2 over the hidden one.
    ops::gemm(rows, F, D, {&w.x[r0 * D], D, 1}, {w1, F, 1}, &w.u[r0 * F], F, false, 1);
    ops::gemm(rows, F, D, {&w.x[r0 * D], D, 1}, {w3, F, 1}, &w.v[r0 * F], F, false, 1);
    ops::swiglu(&w.u[r0 * F], &w.v[r0 * F], &w.sg[r0 * F], &w.act[r0 * F], rows * F);
    ops::gemm(rows, D, F, {&w.act[r0 * F], F, 1}, {w2, D, 1}, &w.y[r0 * D], D, false, 1);
    for (int64_t r = r0; r < r0 + rows; ++r)
      if (!w.dropped.empty() && w.dropped[r]) std::fill(&w.y[r * D], &w.y[(r + 1) * D], 0.0f);
  });
}

namespace {

// Backward of rows [r0, r0 + rows) of expert e.
void backward_rows(ExpertWork& w, int e, int64_t r0, int64_t rows, const float* W1, const float* W3, const float* W2,
                   int D, int F) {
  const float *w1 = W1 + (int64_t)e * D * F, *w3 = W3 + (int64_t)e * D * F, *w2 = W2 + (int64_t)e * F * D;
  // dact reduces over the model feature; dx over the hidden index of u, then continues over that of v.
  ops::gemm(rows, F, D, {&w.dy[r0 * D], D, 1}, {w2, 1, D}, &w.dact[r0 * F], F, false, 1);
  ops::swiglu_backward(&w.u[r0 * F], &w.v[r0 * F], &w.sg[r0 * F], &w.dact[r0 * F], &w.du[r0 * F], &w.dv[r0 * F],
                       rows * F);
  ops::gemm(rows, D, F, {&w.du[r0 * F], F, 1}, {w1, 1, F}, &w.dx[r0 * D], D, false, 1);
  ops::gemm(rows, D, F, {&w.dv[r0 * F], F, 1}, {w3, 1, F}, &w.dx[r0 * D], D, true, 1);
  for (int64_t r = r0; r < r0 + rows; ++r)
    if (!w.dropped.empty() && w.dropped[r]) {
      std::fill(&w.dx[r * D], &w.dx[(r + 1) * D], 0.0f);
      std::fill(&w.du[r * F], &w.du[(r + 1) * F], 0.0f);
      std::fill(&w.dv[r * F], &w.dv[(r + 1) * F], 0.0f);
    }
}

void size_backward(ExpertWork& w, int D, int F) {
  const int64_t R = w.rows();
  w.dact.resize(R * F);
  w.du.resize(R * F);
  w.dv.resize(R * F);
  w.dx.resize(R * D);
}

// Leaf offsets of each expert's rows (rows are in leaf order): [experts][leaves + 1].
std::vector<int64_t> expert_leaf_offsets(const ExpertWork& w, int64_t leaves) {
  std::vector<int64_t> eoff((size_t)w.experts * (leaves + 1));
  for (int e = 0; e < w.experts; ++e) {
    int64_t* off = &eoff[(size_t)e * (leaves + 1)];
    int64_t r = w.off[e];
    for (int64_t lf = 0; lf <= leaves; ++lf) {
      while (r < w.off[e + 1] && w.leaf[r] < lf) ++r;
      off[lf] = r - w.off[e];
    }
  }
  return eoff;
}

// One of expert e's three weight gradients (which: 0 = W1, 1 = W3, 2 = W2).
// Each reduces over the global token index of the expert's rows (leaf tree).
void weight_grad_of(const ExpertWork& w, int e, int which, const int64_t* off, int64_t leaves, int D, int F,
                    float* gW1, float* gW3, float* gW2) {
  const int64_t r0 = w.off[e];
  if (which == 0)
    ops::weight_grad(&w.x[r0 * D], D, &w.du[r0 * F], F, D, F, off, leaves, gW1 + (int64_t)e * D * F);
  else if (which == 1)
    ops::weight_grad(&w.x[r0 * D], D, &w.dv[r0 * F], F, D, F, off, leaves, gW3 + (int64_t)e * D * F);
  else
    ops::weight_grad(&w.act[r0 * F], F, &w.dy[r0 * D], D, F, D, off, leaves, gW2 + (int64_t)e * F * D);
}

}  // namespace

void experts_backward(ExpertWork& w, const float* W1, const float* W3, const float* W2, int D, int F) {
  size_backward(w, D, F);
  const auto tasks = row_tasks(w);
  parallel_tasks((int64_t)tasks.size(), [&](int64_t t) {
    const int e = tasks[t].first;
    const int64_t r0 = tasks[t].second, rows = std::min(kRowBlock, w.off[e + 1] - r0);
    backward_rows(w, e, r0, rows, W1, W3, W2, D, F);
  });
}

void experts_backward_with_weight_grads(ExpertWork& w, const float* W1, const float* W3, const float* W2, int D,
                                        int F, int64_t leaves, float* gW1, float* gW3, float* gW2) {
  if (!run_inline(2)) {  // threads: rows and gradients as separate, evenly split loops
    experts_backward(w, W1, W3, W2, D, F);
    experts_weight_grads(w, leaves, D, F, gW1, gW3, gW2);
    return;
  }
  // One thread: each expert's gradients right after its rows' backward,
  // while its du, dv, dy and x are still in cache; all its rows in one GEMM
  // each, so the transposed weights are packed once per expert.
  size_backward(w, D, F);
  const std::vector<int64_t> eoff = expert_leaf_offsets(w, leaves);
  for (int e = 0; e < w.experts; ++e) {
    if (w.off[e + 1] > w.off[e]) backward_rows(w, e, w.off[e], w.off[e + 1] - w.off[e], W1, W3, W2, D, F);
    for (int which = 0; which < 3; ++which)
      weight_grad_of(w, e, which, &eoff[(size_t)e * (leaves + 1)], leaves, D, F, gW1, gW3, gW2);
  }
}

void experts_weight_grads(const ExpertWork& w, int64_t leaves, int D, int F, float* gW1, float* gW3, float* gW2) {
  const std::vector<int64_t> eoff = expert_leaf_offsets(w, leaves);
  parallel_tasks(3 * w.experts, [&](int64_t task) {
    const int e = task / 3;
    weight_grad_of(w, e, task % 3, &eoff[(size_t)e * (leaves + 1)], leaves, D, F, gW1, gW3, gW2);
  });
}

}  // namespace ls
