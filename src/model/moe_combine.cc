// The moe_combine block: the shared expert (if any), then the layer's
// output, residual + the gated sum of the token's expert outputs over its
// slots + the shared expert's, and the layer's load-balancing and z losses.
// Matches ref::MoeCombine.
#include <string>
#include <vector>

#include "contract.h"
#include "model/blocks.h"
#include "model/context_parallel.h"
#include "model/expert_parallel.h"
#include "model/step_sums.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace ls {

namespace {

class MoeCombine : public LayerBlock {
 public:
  explicit MoeCombine(int layer) : LayerBlock(layer, "moe_combine") {}

  void forward(StepContext& ctx, StepLosses& losses) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, F = ctx.d_ff_held(), E = c.experts, K = c.top_k;
    // The shared expert runs on every token (context parallel: this rank's positions);
    // the combine on the stream's tokens held here.
    const int64_t N = ctx.tokens, Ns = ctx.stream_tokens, first = ctx.stream_first;
    LayerActs& acts = ctx.layer(layer_);
    float* out = ctx.stream(layer_ + 1);
    if (c.shared_expert) {
      acts.shared_u.resize(N * F);
      acts.shared_v.resize(N * F);
      acts.shared_gate.resize(N * F);
      acts.shared_act.resize(N * F);
      acts.shared_out.resize(N * D);
      const float* w1 = ctx.layer_weight(layer_, "shared.w1");
      const float* w3 = ctx.layer_weight(layer_, "shared.w3");
      // Context parallel: this rank's positions' rows (rows are independent), gathered after.
      rows_held_untimed(ctx, [&](int64_t row, int count) {
        ops::linear(acts.moe_in.data() + row * D, count, D, w1, F, acts.shared_u.data() + row * F);
        ops::linear(acts.moe_in.data() + row * D, count, D, w3, F, acts.shared_v.data() + row * F);
        ops::swiglu(acts.shared_u.data() + row * F, acts.shared_v.data() + row * F, acts.shared_gate.data() + row * F,
                    acts.shared_act.data() + row * F, count * F);
      });
      progress_round_exchange(ctx);
      // Reduces over the hidden feature (tensor parallel: chained across the group's ranges of it).
      const float* w2 = ctx.layer_weight(layer_, "shared.w2");
      chained_fold(ctx, 1, stream_output(ctx, acts.shared_out.data()), [&](int, int, bool accumulate, RowBlock block) {
        rows_held_untimed(ctx, block, [&](int64_t row, int count) {
          ops::linear_strided(acts.shared_act.data() + row * F, F, count, F, w2, D, D, acts.shared_out.data() + row * D,
                              D, accumulate);
        });
      });
    }
    finish_round_exchange(ctx);  // expert parallel: the rows the shared expert's compute hid, now in place
    // out = fold over slots of fma(gate, y_slot, out) from +0, then + shared, + residual.
    stream_rows(ctx, StreamOp::kCombine, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::moe_combine(acts.gates.data() + s * E, E, acts.sel.data() + row * K, K, acts.row_of.data() + row * K,
                       acts.ye_rows, c.shared_expert ? acts.shared_out.data() + row * D : nullptr,
                       acts.mid.data() + s * D, out + s * D, count, D);
    });
    ctx.trace_tensor("fwd", layer_, "moe.combine", "h", out, {N, D}, {TraceRows::kStream});
    // Load balancing (E * sum_e f_e P_e) and z-loss (mean lse^2): token reductions.
    // This rank's subtrees (ops::router_stats), then the canonical tree over ranks.
    StepWorkspace& ws = ctx.ws;
    ops::DeviceVector<float>& sums = ws.router_sums;
    const bool per_sample = c.aux_scope == AuxScope::kSequence;
    sums.resize(E + 1 + (per_sample ? 1 : 0));
    ops::router_stats(acts.gates.data(), acts.router_lse.data(), Ns, E, ctx.leaf_tokens, ctx.stream_leaves, sums.data());
    ops::synchronize();  // read by the host (and the sum over the step)
    // The stream's samples' balance losses, summed as the router sums are: a third token reduction.
    if (per_sample)
      sums[E + 1] = sequence_balance(acts.gates.data(), acts.sel.data() + first * K, Ns / c.seq_len, c.seq_len, E, K,
                                     ctx.leaf_tokens / c.seq_len, acts.sample_counts);
    if (!sum_over_step(ctx, sums.data(), sums.size(), acts.router_partial)) return;
    sum_counts_over_step(ctx, acts.global_counts.data(), E);
    const LayerBalance balance =
        layer_balance(c, sums.data(), acts.global_counts.data(), ctx.global_tokens, ctx.global_assignments);
    ws.aux_loss[layer_] = balance.aux;
    ws.z_loss[layer_] = balance.z;
    // The step's sums fold layer by layer, in layer order.
    losses.aux = losses.aux + ws.aux_loss[layer_];
    losses.z = losses.z + ws.z_loss[layer_];
  }

  // dh (the gradient of the layer's output) -> the gates' gradient dg and
  // the expert outputs' dye; the shared expert's weight gradients and its
  // input gradient (added by the dispatch block). The residual's gradient
  // stays in dh for the routing block's norm to add to.
  void backward(StepContext& ctx) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, F = ctx.d_ff_held(), E = c.experts, K = c.top_k;
    const int64_t N = ctx.tokens, Ns = ctx.stream_tokens, first = ctx.stream_first;
    StepWorkspace& ws = ctx.ws;
    LayerActs& acts = ctx.layer(layer_);
    ws.dye.resize((int64_t)acts.row_token.size() * D);  // every row of the experts' batch
    ws.dg.resize(Ns * E);
    ops::fill(ws.dg.data(), Ns * E, 0.0f);
    stream_rows(ctx, StreamOp::kCombine, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::moe_combine_backward(ws.dh.data() + s * D, acts.gates.data() + s * E, E, acts.sel.data() + row * K, K,
                                acts.row_of.data() + row * K, acts.ye_rows, ws.dg.data() + s * E, ws.dye.data(), count,
                                D);
    });
    gather_slot_rows_held(ctx, acts, ws.dye.data(), D);  // context parallel: every slot's, for the experts
    gather_expert_output_grads(ctx, acts);
    if (!c.shared_expert) return;
    gather_stream_rows_held(ctx, ws.dh.data(), D);  // every token's, for the shared expert's w2 gradient
    // Expert parallel: the experts' first round of gradients leaves now, hidden behind the shared expert's backward.
    if (exchange_overlaps_shared_expert(ctx, acts)) start_round_output_grads(ctx, acts, 0);
    const float* w1 = ctx.layer_weight(layer_, "shared.w1");
    const float* w3 = ctx.layer_weight(layer_, "shared.w3");
    const float* w2 = ctx.layer_weight(layer_, "shared.w2");
    ws.shared_du.resize(N * F);
    ws.shared_dv.resize(N * F);
    ws.shared_dx.resize(N * D);
    ws.shared_dact.resize(N * F);
    // Sequence parallel: every token's, started on the rows at hand; context parallel: this rank's positions' rows.
    const auto hidden_grads = [&](const float* d, int64_t row, int count) {
      ops::linear_input_grad(d, count, D, w2, F, ws.shared_dact.data() + row * F, false);
      ops::swiglu_backward(acts.shared_u.data() + row * F, acts.shared_v.data() + row * F,
                           acts.shared_gate.data() + row * F, ws.shared_dact.data() + row * F,
                           ws.shared_du.data() + row * F, ws.shared_dv.data() + row * F, count * F);
    };
    const float* dout = rows_held_of_stream(ctx, ws.dh.data(), ws.sp_dh, false, hidden_grads);
    progress_round_exchange(ctx);
    // Reduces over the hidden feature of u, then continues over that of v (tensor parallel: chained).
    chained_fold(ctx, 2, stream_output(ctx, ws.shared_dx.data()),
                 [&](int first_pass, int count, bool accumulate, RowBlock block) {
      rows_held_untimed(ctx, block, [&](int64_t row, int rows) {
        for (int pass = first_pass; pass < first_pass + count; ++pass)
          ops::linear_input_grad((pass == 0 ? ws.shared_du.data() : ws.shared_dv.data()) + row * F, rows, F,
                                 pass == 0 ? w1 : w3, D, ws.shared_dx.data() + row * D, accumulate || pass > first_pass);
      });
    });
    // Context parallel: every token's rows for the weight gradients.
    for (float* m : {ws.shared_du.data(), ws.shared_dv.data(), acts.shared_act.data()}) gather_rows_held(ctx, m, F);
    token_weight_grad(ctx, acts.moe_in.data(), D, ws.shared_du.data(), F, D, F, ctx.layer_grad(layer_, "shared.w1"));
    progress_round_exchange(ctx);
    token_weight_grad(ctx, acts.moe_in.data(), D, ws.shared_dv.data(), F, D, F, ctx.layer_grad(layer_, "shared.w3"));
    progress_round_exchange(ctx);
    token_weight_grad(ctx, acts.shared_act.data(), F, dout, D, F, D, ctx.layer_grad(layer_, "shared.w2"));
  }

};

}  // namespace

std::unique_ptr<Block> make_moe_combine_block(int layer) { return std::make_unique<MoeCombine>(layer); }

}  // namespace ls
