// The moe_experts block: the routed experts' SwiGLU over their rows, in the
// rounds and slots of the layer's plan, each round's rows exchanged to
// their owners and back. Matches ref::MoeExperts (per row: independent;
// weight gradients: each expert's leaf tree over its rows). Context
// parallel: each rank of the group computes a block of the experts over
// all their rows, and the group gathers the results (context_parallel.h).
#include <algorithm>
#include <string>
#include <vector>

#include "model/blocks.h"
#include "model/context_parallel.h"
#include "model/moe_exchange.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace ls {

namespace {

class MoeExperts : public LayerBlock {
 public:
  explicit MoeExperts(int layer) : LayerBlock(layer, "moe_experts") {}

  // moe_in rows -> ye (dispatch order).
  void forward(StepContext& ctx, StepLosses&) override {
    const int D = ctx.cfg.d_model, F = ctx.d_ff_held(), ep = ctx.ep;
    StepWorkspace& ws = ctx.ws;
    LayerActs& acts = ctx.layer(layer_);
    ExpertRows& rows = acts.rows;
    RoundPlan cp_plan;
    const RoundPlan& own = computed_plan(ctx, acts, cp_plan);
    const ExpertWeights w = weights(ctx);
    for (int r = 0; r < exchange_rounds(acts); ++r) {
      exchange_rows(ctx, acts, r, D, /*to_owner=*/true, acts.moe_in.data(),
                    [&](int64_t disp) { return acts.row_token[disp]; }, ws.slots.x.data(),
                    ep > 1 ? rows.x.data() : nullptr, nullptr);
      // Without expert parallelism the outputs go straight to the dispatch rows the combine reads.
      const RowPlace y = ep > 1 ? RowPlace{ws.slots.y.data(), true} : RowPlace{acts.ye.data(), false};
      if (r < own.rounds()) {
        ctx.stats.expert_gemm_calls += experts_round_hidden(own, r, ws.slots, rows, w.w1, w.w3, D, F);
        // y reduces over the hidden feature (tensor parallel: chained across the group's ranges of it).
        chained_fold(ctx, 1, round_chain(own, r, rows, y, D), [&](int, int, bool accumulate) {
          ctx.stats.expert_gemm_calls += experts_round_output(own, r, ws.slots, rows, y, w.w2, D, F, accumulate);
        });
      }
      if (ep > 1) exchange_rows(ctx, acts, r, D, /*to_owner=*/false, nullptr, nullptr, ws.slots.y.data(), nullptr, acts.ye.data());
    }
    if (ctx.cp > 1) cp_gather_expert_rows(ctx, acts, acts.ye.data(), D);  // every block's rows, here
    const RoundPlan& planned = ctx.own_plan(acts);
    ctx.stats.rounds = std::max(ctx.stats.rounds, planned.rounds());
    ctx.stats.borrowed += planned.borrowed;
    ctx.stats.dropped += planned.dropped;
    acts.ye_rows = acts.ye.data();
    if (ctx.trace)
      ctx.trace_tensor("fwd", layer_, "moe.experts", "out", ctx.token_slot_order(acts, acts.ye_rows, D),
                       {ctx.tokens, ctx.cfg.top_k, D});
  }

  // dye (dispatch order) -> dxe; the experts' weight gradients. Backward in
  // the forward's rounds and slots; the weight-gradient leaf trees continue
  // from round to round.
  void backward(StepContext& ctx) override {
    const int D = ctx.cfg.d_model, F = ctx.d_ff_held(), ep = ctx.ep;
    const int64_t NK = ctx.tokens * ctx.cfg.top_k;
    StepWorkspace& ws = ctx.ws;
    LayerActs& acts = ctx.layer(layer_);
    ExpertRows& rows = acts.rows;
    RoundPlan cp_plan;
    const RoundPlan& own = computed_plan(ctx, acts, cp_plan);
    const ExpertWeights w = weights(ctx);
    float* grad_w1 = ctx.layer_grad(layer_, "experts.w1");
    float* grad_w3 = ctx.layer_grad(layer_, "experts.w3");
    float* grad_w2 = ctx.layer_grad(layer_, "experts.w2");
    ws.dxe.resize(NK * D);
    if (ctx.cfg.moe_policy == MoePolicy::kDrop) ops::fill(ws.dxe.data(), NK * D, 0.0f);  // skipped rows: no gradient
    ExpertWeightGrads& grads = ws.expert_grads;  // kept: its buffers are reused layer to layer
    ExpertGradsBySource& by_source = (*ctx.source_grads)[(size_t)layer_];
    if (!ctx.grads_by_source()) grads.begin(own, rows, ctx.leaves * ep, D, F, &ws.grad_state);
    else if (ctx.microbatch == 0) by_source.begin(ctx.local_experts, ep, ctx.leaves * ctx.microbatches, D, F);
    count_moe_memory(ctx);
    // Without expert parallelism dy and dx stay in the dispatch rows (the experts' row order).
    const RowPlace dy = ep > 1 ? RowPlace{ws.slots.dy.data(), true} : RowPlace{ws.dye.data(), false};
    const RowPlace dx = ep > 1 ? RowPlace{ws.slots.dx.data(), true} : RowPlace{ws.dxe.data(), false};
    for (int r = 0; r < exchange_rounds(acts); ++r) {
      if (ep > 1)
        exchange_rows(ctx, acts, r, D, /*to_owner=*/true, ws.dye.data(), [](int64_t disp) { return disp; },
                      ws.slots.dy.data(), nullptr, nullptr);
      if (r < own.rounds()) {
        // The inputs again, into the same slots: from the layer's input rows
        // (kept per row with expert parallelism).
        if (ep == 1) {
          exchange_rows(ctx, acts, r, D, true, acts.moe_in.data(), [&](int64_t disp) { return acts.row_token[disp]; },
                        ws.slots.x.data(), nullptr, nullptr);
        } else {
          ops::synchronize();
          ws.from_row.clear();
          ws.to_row.clear();
          for (const Segment& s : own.round[r])
            for (int64_t t = 0; t < s.rows; ++t) {
              ws.from_row.push_back(rows.off[s.expert] + s.first + t);
              ws.to_row.push_back(s.slot + t);
            }
          ops::copy_rows(rows.x.data(), ws.from_row.data(), ws.slots.x.data(), ws.to_row.data(),
                         (int64_t)ws.to_row.size(), D);
        }
        ctx.stats.expert_gemm_calls += experts_round_backward_hidden(own, r, ws.slots, rows, dy, w.w2, D, F);
        // dx reduces over the hidden feature of u, then of v (tensor parallel: chained).
        chained_fold(ctx, 2, round_chain(own, r, rows, dx, D), [&](int first, int count, bool accumulate) {
          ctx.stats.expert_gemm_calls +=
              experts_round_input_grad(own, r, ws.slots, rows, dx, w.w1, w.w3, D, F, first, count, accumulate);
        });
        if (ctx.grads_by_source()) by_source.add_round(own, r, ws.slots, rows, dy);
        else grads.add_round(own, r, ws.slots, rows, dy, grad_w1, grad_w3, grad_w2);
      }
      if (ep > 1) exchange_rows(ctx, acts, r, D, /*to_owner=*/false, nullptr, nullptr, ws.slots.dx.data(), nullptr, ws.dxe.data());
    }
    if (ctx.cp > 1) cp_gather_expert_rows(ctx, acts, ws.dxe.data(), D);
    bool finished = false;
    if (!ctx.grads_by_source()) {
      grads.finish(grad_w1, grad_w3, grad_w2);
      ctx.stats.expert_gemm_calls += grads.calls();
      finished = true;
    } else if (ctx.microbatch == ctx.microbatches - 1) {  // the step's gradients, once every microbatch is in
      by_source.finish(grad_w1, grad_w3, grad_w2);
      ctx.stats.expert_gemm_calls += by_source.calls();
      ctx.stats.peak_grad_state_bytes = std::max(ctx.stats.peak_grad_state_bytes, by_source.state_bytes());
      finished = true;
    }
    if (ctx.cp > 1 && finished)  // each block's gradients folded whole on its rank
      for (float* g : {grad_w1, grad_w3, grad_w2}) cp_gather_expert_grads(ctx, g, (int64_t)D * F);
    if (ctx.trace)
      ctx.trace_tensor("bwd", layer_, "moe.experts", "dx", ctx.token_slot_order(acts, ws.dxe.data(), D),
                       {ctx.tokens, ctx.cfg.top_k, D});
  }


 private:
  // The plan this rank computes: its EP rank's, or with context parallel
  // its block of those experts (kept in `cp_plan`).
  static const RoundPlan& computed_plan(const StepContext& ctx, const LayerActs& acts, RoundPlan& cp_plan) {
    if (ctx.cp == 1) return ctx.own_plan(acts);
    cp_plan = cp_own_experts(ctx, ctx.own_plan(acts));
    return cp_plan;
  }
  // A round's rows at `place` as a chained fold's output: packed in segment order.
  static ChainOutput round_chain(const RoundPlan& plan, int r, const ExpertRows& rows, RowPlace place, int D) {
    ChainOutput out;
    out.floats = round_rows(plan, r) * D;
    out.pack = [&plan, r, &rows, place, D](float* buffer) { pack_round_rows(plan, r, rows, place, D, buffer); };
    out.unpack = [&plan, r, &rows, place, D](const float* buffer) { unpack_round_rows(plan, r, rows, place, D, buffer); };
    return out;
  }
  struct ExpertWeights {
    const float *w1, *w3, *w2;  // [experts held, D, F], [.., D, F], [.., F, D]
  };
  ExpertWeights weights(const StepContext& ctx) const {
    return {ctx.layer_weight(layer_, "experts.w1"), ctx.layer_weight(layer_, "experts.w3"),
            ctx.layer_weight(layer_, "experts.w2")};
  }
};

}  // namespace

std::unique_ptr<Block> make_moe_experts_block(int layer) { return std::make_unique<MoeExperts>(layer); }

}  // namespace ls
