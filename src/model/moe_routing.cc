// The moe_routing block: RMSNorm of the stream after attention, router
// logits (plus the optional fixed skew), softmax gates and the top-k
// choice per token. Backward: the router's gradient (the combine's gate
// gradient + the load-balancing term, softmax backward, + the z-loss term)
// and the norm's, added to the residual's. Matches ref::MoeRouting.
#include <algorithm>
#include <string>

#include "model/blocks.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace ls {

namespace {

class MoeRouting : public LayerBlock {
 public:
  explicit MoeRouting(int layer) : LayerBlock(layer, "moe_routing") {}
  bool begins_at_stream() const override { return true; }
  float* stream_in(StepWorkspace& ws) const override { return ws.layers[layer_].mid.data(); }

  void forward(StepContext& ctx, StepLosses&) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, E = c.experts, K = c.top_k;
    // The stream's tokens held here (sequence parallel: a TP rank's share);
    // the experts and the dispatch then read every token's moe_in and choices.
    const int64_t N = ctx.stream_tokens;
    LayerActs& acts = ctx.layer(layer_);
    StepWorkspace& ws = ctx.ws;
    const float* norm = ctx.layer_weight(layer_, "moe_norm");
    acts.moe_in.resize(ctx.tokens * D);
    float* moe_in = stream_rows_out(ctx, acts.moe_in, ws.sp_rows, D);  // sequence parallel: this rank's, gathered below
    acts.moe_inv_rms.resize(N);
    if (ctx.debug_reorder_moe_norm)
      ops::rmsnorm_debug_reversed(acts.mid.data(), norm, moe_in, acts.moe_inv_rms.data(), N, D, c.rms_eps);
    else
      ops::rmsnorm(acts.mid.data(), norm, moe_in, acts.moe_inv_rms.data(), N, D, c.rms_eps);
    ctx.trace_tensor("fwd", layer_, "moe_norm", "out", moe_in, {N, D}, {TraceRows::kStream});
    acts.router_logits.resize(N * E);
    acts.gates.resize(N * E);
    acts.router_lse.resize(N);
    acts.sel.resize(ctx.tokens * K);
    ops::linear(moe_in, N, D, ctx.layer_weight(layer_, "router"), E, acts.router_logits.data());
    if (c.router_skew != 0) {  // a fixed preference for the first max(1, E/4) experts
      ops::synchronize();
      ctx.ws.row_vector.assign(std::max(1, E / 4), c.router_skew);
      ops::add_row_vector(acts.router_logits.data(), N, E, std::max(1, E / 4), ctx.ws.row_vector.data());
    }
    ops::softmax_rows(acts.router_logits.data(), E, acts.gates.data(), E, (int)N, E, 0, acts.router_lse.data());
    ops::route_topk(acts.gates.data(), N, E, K, stream_rows_out(ctx, acts.sel, ws.sel_held, K));
    // Every token's input row and choices, for the dispatch and the experts.
    gather_stream_rows(ctx, ws.sp_rows, acts.moe_in, D);
    gather_stream_rows(ctx, ws.sel_held, acts.sel, K);
    ops::synchronize();  // the host plans the rounds from the routing choices
    ctx.trace_tensor("fwd", layer_, "router", "logits", acts.router_logits.data(), {N, E}, {TraceRows::kStream});
    ctx.trace_tensor("fwd", layer_, "router", "gates", acts.gates.data(), {N, E}, {TraceRows::kStream});
  }

  // dg (from the combine) and d(moe_in) (from the dispatch) -> the router's
  // and the norm's weight gradients; dh += the norm's input gradient.
  void backward(StepContext& ctx) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, E = c.experts;
    const int64_t N = ctx.stream_tokens;  // the stream's tokens held here
    StepWorkspace& ws = ctx.ws;
    const LayerActs& acts = ctx.layer(layer_);
    const float* moe_in = acts.moe_in.data() + ctx.stream_first * D;
    // The gate gradient + the aux term (the counts are constants), softmax
    // backward, + the z-loss term.
    ops::synchronize();
    // One vector for every row (the step's counts), or with moe.aux_scope=sequence one per sample (its own).
    const bool per_sample = c.aux_scope == AuxScope::kSequence;
    const int64_t rows = per_sample ? c.seq_len : N, vectors = N / rows;
    const int64_t* counts = per_sample ? acts.sample_counts.data() : acts.global_counts.data();
    const float assignments = per_sample ? (float)(rows * c.top_k) : ctx.global_assignments;
    ws.row_vector.resize(vectors * E);
    for (int64_t s = 0; s < vectors; ++s)
      for (int e = 0; e < E; ++e) {
        const float f = (float)counts[s * E + e] / assignments;
        ws.row_vector[s * E + e] = ((c.aux_loss_weight * (float)E) * f) / ctx.global_tokens;
      }
    for (int64_t s = 0; s < vectors; ++s)
      ops::add_row_vector(ws.dg.data() + s * rows * E, rows, E, E, ws.row_vector.data() + s * E);
    ws.dz.resize(N * E);
    ops::softmax_backward_rows(acts.gates.data(), E, ws.dg.data(), E, ws.dz.data(), E, (int)N, E, 0);
    ops::z_loss_grad(acts.gates.data(), acts.router_lse.data(), N, E, c.z_loss_weight * 2.0f, ctx.global_tokens,
                     ws.dz.data());
    ctx.trace_tensor("bwd", layer_, "router", "dz", ws.dz.data(), {N, E}, {TraceRows::kStream});
    ops::weight_grad(moe_in, D, ws.dz.data(), E, D, E, ws.uniform_off.data(), ctx.stream_leaves,
                     ctx.layer_grad(layer_, "router"));
    ws.dtmp.resize(N * D);
    ops::linear_input_grad(ws.dz.data(), N, E, ctx.layer_weight(layer_, "router"), D, ws.dtmp.data(), false);
    ops::add(ws.dmoe_in.data(), ws.dtmp.data(), ws.dmoe_in.data(), N * D);
    ops::rmsnorm_weight_grad(acts.mid.data(), acts.moe_inv_rms.data(), ws.dmoe_in.data(), N, D, ctx.leaf_tokens,
                             ctx.layer_grad(layer_, "moe_norm"));
    ops::rmsnorm_backward(acts.mid.data(), ctx.layer_weight(layer_, "moe_norm"), acts.moe_inv_rms.data(),
                          ws.dmoe_in.data(), ws.dh.data(), N, D, true);
    ctx.trace_tensor("bwd", layer_, "moe_norm", "dh", ws.dh.data(), {N, D}, {TraceRows::kStream});
  }

};

}  // namespace

std::unique_ptr<Block> make_moe_routing_block(int layer) { return std::make_unique<MoeRouting>(layer); }

}  // namespace ls
