// The moe_dispatch block. Forward: each (token, slot) pair becomes a row of
// its expert, rows grouped by expert in token order; the EP group learns
// every rank's counts and derives the same round plans
// (model/expert_parallel.h). Backward: the reference's dispatch adjoint, a
// sum over each token's slots (ops::slot_sum). Matches ref::MoeDispatch.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "model/blocks.h"
#include "model/context_parallel.h"
#include "model/expert_parallel.h"
#include "ops/ops.h"

namespace ls {

namespace {

class MoeDispatch : public LayerBlock {
 public:
  explicit MoeDispatch(int layer) : LayerBlock(layer, "moe_dispatch") {}

  void forward(StepContext& ctx, StepLosses&) override {
    const ModelConfig& c = ctx.cfg;
    const int E = c.experts, K = c.top_k;
    LayerActs& acts = ctx.layer(layer_);
    // This rank's assignments per expert (the balance loss's counts, summed over the step by the combine).
    acts.global_counts.assign(E, 0);
    for (int64_t i = 0; i < ctx.tokens * K; ++i) ++acts.global_counts[acts.sel[i]];
    for (int e = 0; e < E; ++e)
      ctx.stats.tokens_per_expert[(size_t)layer_ * E + e] += acts.global_counts[e];  // every pass of the step adds up
    // The experts' batch: these tokens, or their token group's (expert_parallel.h).
    gather_expert_batch(ctx, acts);
    std::optional<StepContext> view;
    StepContext& batch = expert_batch(ctx, view);
    const int64_t N = batch.tokens, NK = N * K;
    const int* sel = acts.batch_sel;
    // Rows grouped by expert, in token order inside each expert.
    acts.expert_off.assign(E + 1, 0);
    for (int64_t i = 0; i < NK; ++i) ++acts.expert_off[sel[i] + 1];
    for (int e = 0; e < E; ++e) acts.expert_off[e + 1] += acts.expert_off[e];
    ops::DeviceVector<int64_t>& row_of = batch_rows_of(ctx, acts);
    row_of.resize(NK);
    acts.row_token.resize(NK);
    {
      std::vector<int64_t> fill(acts.expert_off.begin(), acts.expert_off.end() - 1);
      for (int64_t n = 0; n < N; ++n)
        for (int s = 0; s < K; ++s) {
          const int64_t row = fill[sel[n * K + s]]++;
          row_of[n * K + s] = row;
          acts.row_token[row] = n;
        }
    }
    own_rows_of(ctx, acts);
    // The rows of the experts held here (docs/MOE.md): local rows, or every
    // EP rank's rows for our experts, ordered by expert, then source rank,
    // then token: the global token order, as the source ranks hold
    // consecutive samples. Every rank learns every rank's counts, so sources
    // and owners derive the same round plans.
    exchange_expert_counts(batch, acts);
    plan_owner_rounds(batch, acts);
    exchange_leaf_ids(batch, acts);
    hold_moe_buffers(batch, acts);
    if (c.moe_policy == MoePolicy::kDrop) ops::fill(acts.ye.data(), (int64_t)acts.ye.size(), 0.0f);  // skipped rows give 0
  }

  // d(moe_in) = (sum over slots, in slot order, from +0) + the shared
  // expert's input gradient; the routing block adds the router's.
  void backward(StepContext& ctx) override {
    StepWorkspace& ws = ctx.ws;
    const int64_t N = ctx.stream_tokens, first = ctx.stream_first;  // the stream's tokens held here
    const int D = ctx.cfg.d_model, K = ctx.cfg.top_k;
    const LayerActs& acts = ctx.layer(layer_);
    ws.dmoe_in.resize(N * D);
    stream_rows(ctx, StreamOp::kDispatchSum, [&](int64_t row, int count) {
      float* dmoe_in = ws.dmoe_in.data() + (row - first) * D;
      ops::slot_sum(ws.dxe.data(), acts.row_of.data() + row * K, K, count, D, dmoe_in);
      if (ctx.cfg.shared_expert) ops::add(dmoe_in, ws.shared_dx.data() + row * D, dmoe_in, (int64_t)count * D);
    });
  }

};

}  // namespace

std::unique_ptr<Block> make_moe_dispatch_block(int layer) { return std::make_unique<MoeDispatch>(layer); }

}  // namespace ls
