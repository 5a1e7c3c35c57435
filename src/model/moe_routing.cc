// The moe_routing block: RMSNorm of the stream after attention, router
// logits (plus the optional fixed skew), softmax gates and the top-k
// choice per token. Backward: the router's gradient (the combine's gate
// gradient + the load-balancing term, softmax backward, + the z-loss term)
// and the norm's, added to the residual's. Matches ref::MoeRouting.
#include <algorithm>
#include <string>

#include "model/blocks.h"
#include "model/context_parallel.h"
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
    const int64_t first = ctx.stream_first;
    stream_rows(ctx, StreamOp::kMoeNorm, [&](int64_t row, int count) {
      const int64_t s = row - first;
      if (ctx.debug_reorder_moe_norm)
        ops::rmsnorm_debug_reversed(acts.mid.data() + s * D, norm, moe_in + s * D, acts.moe_inv_rms.data() + s, count,
                                    D, c.rms_eps);
      else
        ops::rmsnorm(acts.mid.data() + s * D, norm, moe_in + s * D, acts.moe_inv_rms.data() + s, count, D, c.rms_eps);
    });
    ctx.trace_tensor("fwd", layer_, "moe_norm", "out", moe_in, {N, D}, {TraceRows::kStream});
    acts.router_logits.resize(N * E);
    acts.gates.resize(N * E);
    acts.router_lse.resize(N);
    acts.sel.resize(ctx.tokens * K);
    int* sel = stream_rows_out(ctx, acts.sel, ws.sel_held, K);
    const float* router = ctx.layer_weight(layer_, "router");
    if (c.router_skew != 0) {  // a fixed preference for the first max(1, E/4) experts
      ops::synchronize();
      ws.row_vector.assign(std::max(1, E / 4), c.router_skew);
    }
    stream_rows(ctx, StreamOp::kRouter, [&](int64_t row, int count) {
      const int64_t s = row - first;
      float* logits = acts.router_logits.data() + s * E;
      ops::linear(moe_in + s * D, count, D, router, E, logits, ops::Operands::kFp32);  // the router: fp32
      if (c.router_skew != 0) ops::add_row_vector(logits, count, E, std::max(1, E / 4), ws.row_vector.data());
      ops::softmax_rows(logits, E, acts.gates.data() + s * E, E, count, E, 0, acts.router_lse.data() + s);
      ops::route_topk(acts.gates.data() + s * E, count, E, K, sel + s * K);
    });
    // Context parallel: the rows a fold over tokens, the dispatch or the experts read, from every rank.
    gather_stream_rows_held(ctx, moe_in, D);
    gather_stream_rows_held(ctx, sel, K);
    gather_stream_rows_held(ctx, acts.gates.data(), E);
    gather_stream_rows_held(ctx, acts.router_lse.data(), 1);
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
    LayerActs& acts = ctx.layer(layer_);
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
    ws.dz.resize(N * E);
    ws.dtmp.resize(N * D);
    const int64_t first = ctx.stream_first;
    const float* router = ctx.layer_weight(layer_, "router");
    stream_rows(ctx, StreamOp::kRouter, [&](int64_t row, int count) {
      const int64_t s = row - first;
      for (int64_t at = s; at < s + count;) {  // each vector's rows of the range
        const int64_t vector = at / rows, end = std::min(s + count, (vector + 1) * rows);
        ops::add_row_vector(ws.dg.data() + at * E, end - at, E, E, ws.row_vector.data() + vector * E);
        at = end;
      }
      ops::softmax_backward_rows(acts.gates.data() + s * E, E, ws.dg.data() + s * E, E, ws.dz.data() + s * E, E, count,
                                 E, 0);
      ops::z_loss_grad(acts.gates.data() + s * E, acts.router_lse.data() + s, count, E, c.z_loss_weight * 2.0f,
                       ctx.global_tokens, ws.dz.data() + s * E);
      ops::linear_input_grad(ws.dz.data() + s * E, count, E, router, D, ws.dtmp.data() + s * D, false,
                             ops::Operands::kFp32);
    });
    ctx.trace_tensor("bwd", layer_, "router", "dz", ws.dz.data(), {N, E}, {TraceRows::kStream});
    gather_stream_rows_held(ctx, ws.dz.data(), E);
    stream_weight_grad(ctx, moe_in, D, ws.dz.data(), E, D, E, ctx.layer_grad(layer_, "router"), ops::Operands::kFp32);
    const float* norm = ctx.layer_weight(layer_, "moe_norm");
    stream_rows(ctx, StreamOp::kMoeNorm, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::add(ws.dmoe_in.data() + s * D, ws.dtmp.data() + s * D, ws.dmoe_in.data() + s * D, count * D);
      ops::rmsnorm_backward(acts.mid.data() + s * D, norm, acts.moe_inv_rms.data() + s, ws.dmoe_in.data() + s * D,
                            ws.dh.data() + s * D, count, D, true);
    });
    // The norm's weight gradient folds over every token: their rows from every rank.
    gather_stream_rows_held(ctx, acts.mid.data(), D);
    gather_stream_rows_held(ctx, acts.moe_inv_rms.data(), 1);
    gather_stream_rows_held(ctx, ws.dmoe_in.data(), D);
    stream_rmsnorm_weight_grad(ctx, acts.mid.data(), acts.moe_inv_rms.data(), ws.dmoe_in.data(),
                               ctx.layer_grad(layer_, "moe_norm"));
    ctx.trace_tensor("bwd", layer_, "moe_norm", "dh", ws.dh.data(), {N, D}, {TraceRows::kStream});
  }

};

}  // namespace

std::unique_ptr<Block> make_moe_routing_block(int layer) { return std::make_unique<MoeRouting>(layer); }

}  // namespace ls
