// Context parallel's split of the routed experts (model/context_parallel.h):
// each rank of a CP group computes a contiguous block of the experts over
// all their rows, and the group gathers the rows and the gradients.
#include "model/context_parallel.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "ops/ops.h"

namespace ls {

const RoundPlan& computed_expert_plan(const StepContext& ctx, const LayerActs& acts, RoundPlan& scratch) {
  if (ctx.cp() == 1) {
    ctx.ws.slots.hidden_base = 0;
    return ctx.own_plan(acts);
  }
  scratch = cp_own_experts(ctx, acts, ctx.own_plan(acts));
  ctx.ws.slots.hidden_base = hidden_slot_range(scratch).first;
  return scratch;
}

CpShare cp_expert_block(const StepContext& ctx, const LayerActs& acts, int owner, int rank) {
  const int cp = ctx.cp(), El = ctx.local_experts;
  const std::vector<int64_t>& load = acts.plans[(size_t)owner].load;
  int64_t total = 0;
  for (int64_t n : load) total += n;
  // A pipeline's expert-parallel gradients accumulate per expert over the microbatches: a fixed block.
  if (ctx.grads_by_source() || total == 0) return cp_share(El, cp, rank);
  // Cut c is the prefix of experts whose rows come nearest c/cp of the total (ties: the shorter prefix).
  auto cut = [&](int c, int from) {
    int best = from;
    int64_t prefix = 0, best_gap = INT64_MAX;
    for (int e = 0; e < from; ++e) prefix += load[(size_t)e];
    for (int e = from; e <= El; prefix += e < El ? load[(size_t)e] : 0, ++e) {
      const int64_t gap = std::llabs(prefix * cp - total * c);
      if (gap < best_gap) best_gap = gap, best = e;
    }
    return best;
  };
  int first = 0;
  for (int c = 1; c <= rank; ++c) first = cut(c, first);
  const int end = rank + 1 == cp ? El : cut(rank + 1, first);
  return {first, end - first};
}

RoundPlan cp_own_experts(const StepContext& ctx, const LayerActs& acts, const RoundPlan& plan) {
  const CpShare b = cp_expert_block(ctx, acts, ctx.ep_rank(), ctx.cp_rank());
  RoundPlan mine = plan;
  for (std::vector<Segment>& round : mine.round)
    round.erase(std::remove_if(round.begin(), round.end(),
                               [&](const Segment& s) { return s.expert < b.first || s.expert >= b.first + b.count; }),
                round.end());
  return mine;
}

void gather_expert_rows(StepContext& ctx, const LayerActs& acts, float* rows, int width) {
  if (ctx.cp() == 1) return;
  ops::synchronize();  // the host packs and unpacks what kernels wrote
  const int cp = ctx.cp(), El = ctx.local_experts;
  // Rank q's rows: for each EP owner, its block of that owner's experts, consecutive in dispatch order.
  auto each_range = [&](int q, const std::function<void(int64_t first, int64_t count)>& fn) {
    for (int owner = 0; owner < ctx.ep(); ++owner) {
      const CpShare b = cp_expert_block(ctx, acts, owner, q);
      if (b.count == 0) continue;
      const int g = owner * El + b.first;
      fn(acts.expert_off[g], acts.expert_off[g + b.count] - acts.expert_off[g]);
    }
  };
  std::vector<size_t> n_each((size_t)cp, 0);
  for (int q = 0; q < cp; ++q) each_range(q, [&](int64_t, int64_t count) { n_each[q] += (size_t)(count * width); });
  size_t total = 0;
  for (size_t n : n_each) total += n;
  ctx.ws.cp_send.resize(std::max<size_t>(1, n_each[(size_t)ctx.cp_rank()]));
  ctx.ws.cp_recv.resize(std::max<size_t>(1, total));
  float* out = ctx.ws.cp_send.data();
  each_range(ctx.cp_rank(), [&](int64_t first, int64_t count) {
    std::memcpy(out, rows + first * width, sizeof(float) * (size_t)(count * width));
    out += count * width;
  });
  all_gather_floats(ctx.group(Axis::kContext), ctx.ws.cp_send.data(), ctx.ws.cp_recv.data(), n_each);
  ctx.stats.cp_bytes_sent += (int64_t)(n_each[(size_t)ctx.cp_rank()] * sizeof(float)) * (cp - 1);
  const float* in = ctx.ws.cp_recv.data();
  for (int q = 0; q < cp; ++q) {
    if (q == ctx.cp_rank()) {
      in += n_each[(size_t)q];
      continue;
    }
    each_range(q, [&](int64_t first, int64_t count) {
      std::memcpy(rows + first * width, in, sizeof(float) * (size_t)(count * width));
      in += count * width;
    });
  }
}

void gather_expert_grads(StepContext& ctx, const LayerActs& acts, float* grad, int64_t per_expert) {
  if (ctx.cp() == 1) return;
  ops::synchronize();
  const int cp = ctx.cp();
  std::vector<size_t> n_each((size_t)cp);
  for (int q = 0; q < cp; ++q)
    n_each[(size_t)q] = (size_t)(cp_expert_block(ctx, acts, ctx.ep_rank(), q).count * per_expert);
  const CpShare mine = cp_expert_block(ctx, acts, ctx.ep_rank(), ctx.cp_rank());
  const size_t total = (size_t)(ctx.local_experts * per_expert);
  ctx.ws.cp_recv.resize(total);
  // The blocks are consecutive and ascending by rank: the concatenation is the whole gradient.
  all_gather_floats(ctx.group(Axis::kContext), grad + mine.first * per_expert, ctx.ws.cp_recv.data(), n_each);
  ctx.stats.cp_bytes_sent += (int64_t)(n_each[(size_t)ctx.cp_rank()] * sizeof(float)) * (cp - 1);
  std::memcpy(grad, ctx.ws.cp_recv.data(), sizeof(float) * total);
}

}  // namespace ls
