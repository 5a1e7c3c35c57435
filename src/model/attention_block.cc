// The attention block of a layer: RMSNorm, the QKV projection, causal
// multi-head attention, the output projection and the residual add.
// Matches ref::Attention.
#include <functional>
#include <string>

#include "contract.h"
#include "model/blocks.h"
#include "model/context_parallel.h"
#include "model/tensor_parallel.h"
#include "ops/attention.h"
#include "ops/ops.h"

namespace ls {

namespace {

class AttentionBlock : public LayerBlock {
 public:
  explicit AttentionBlock(int layer) : LayerBlock(layer, "attention") {}
  bool begins_at_stream() const override { return true; }
  float* stream_in(StepWorkspace& ws) const override { return ws.layers[layer_].x.data(); }

  // x -> mid = x + wo(attention(wqkv(RMSNorm(x)))). Tensor parallel: this
  // rank's heads only (QKV column-parallel), the output projection's fold
  // over their features chained across the group (row-parallel). Sequence
  // parallel: the norm and the residual on this rank's stream tokens, the
  // norm's output gathered before QKV, the projection landing scattered.
  // Context parallel: every op on this rank's positions, K and V
  // all-gathered.
  void forward(StepContext& ctx, StepLosses&) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, Dh = ctx.width_held();
    const int64_t N = ctx.tokens, Ns = ctx.stream_tokens;
    LayerActs& acts = ctx.layer(layer_);
    StepWorkspace& ws = ctx.ws;
    acts.attn_in.resize(Ns * D);
    acts.attn_inv_rms.resize(Ns);
    const int64_t first = ctx.stream_first;
    const float* norm = ctx.layer_weight(layer_, "attn_norm");
    stream_rows(ctx, StreamOp::kAttnNorm, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::rmsnorm(acts.x.data() + s * D, norm, acts.attn_in.data() + s * D, acts.attn_inv_rms.data() + s, count, D,
                   c.rms_eps);
    });
    ctx.trace_tensor("fwd", layer_, "attn_norm", "out", acts.attn_in.data(), {N, D}, {TraceRows::kStream});
    acts.qkv.resize(N * 3 * Dh);
    acts.attn_out.resize(N * Dh);
    attention_forward_held(ctx, layer_, acts.attn_in.data(), ctx.layer_weight(layer_, "wqkv"), acts);
    ws.dtmp.resize(N * D);
    // Reduces over the attention features, this rank's heads' range of them.
    const float* wo = ctx.layer_weight(layer_, "wo");
    chained_fold(ctx, 1, stream_output(ctx, ws.dtmp.data()), [&](int, int, bool accumulate, RowBlock block) {
      rows_held(ctx, block, [&](int64_t row, int count) {
        ops::linear_strided(acts.attn_out.data() + row * Dh, Dh, count, Dh, wo, D, D, ws.dtmp.data() + row * D, D,
                            accumulate);
      });
    });
    stream_rows(ctx, StreamOp::kAttnResidual, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::add(acts.x.data() + s * D, ws.dtmp.data() + row * D, acts.mid.data() + s * D, (int64_t)count * D);
    });
    ctx.trace_tensor("fwd", layer_, "attn_residual", "h", acts.mid.data(), {N, D}, {TraceRows::kStream});
  }

  // dh: d(mid) in, d(x) out (the residual's part + the norm's). Tensor
  // parallel: the norm's input gradient folds over every head's q, k and v
  // features, chained across the group. Context parallel: the input
  // gradients of this rank's positions; the weight gradients over every
  // token's rows, gathered, a share of the columns each.
  void backward(StepContext& ctx) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, Dh = ctx.width_held();
    const int64_t N = ctx.tokens;
    StepWorkspace& ws = ctx.ws;
    LayerActs& acts = ctx.layer(layer_);
    // Sequence parallel: the projection's gradients need every token's d(mid).
    const float* wo = ctx.layer_weight(layer_, "wo");
    ws.dattn_out.resize(N * Dh);
    gather_stream_rows_held(ctx, ws.dh.data(), D);  // context parallel: every token's d(mid), for wo's gradient
    const auto dattn_rows = [&](const float* d, int64_t row, int count) {
      ops::linear_input_grad(d, count, D, wo, Dh, ws.dattn_out.data() + row * Dh, false);
    };
    const float* dmid = rows_held_of_stream(ctx, ws.dh.data(), ws.sp_dh, true, dattn_rows);
    // Context parallel: every token's attention output, for wo's gradient.
    gather_rows_held(ctx, acts.attn_out.data(), Dh);
    token_weight_grad(ctx, acts.attn_out.data(), Dh, dmid, D, Dh, D, ctx.layer_grad(layer_, "wo"));
    ws.dqkv.resize(N * 3 * Dh);
    attention_backward_held(ctx, acts, ws.dattn_out.data(), ws.dqkv.data());
    ctx.trace_tensor("bwd", layer_, "attention", "dqkv", ws.dqkv.data(), {N, 3 * D}, {TraceRows::kHeld, 3});
    gather_stream_rows_held(ctx, acts.attn_in.data(), D);  // context parallel: every token's, for wqkv's gradient
    token_weight_grad(ctx, every_token(ctx, acts.attn_in.data(), ws.sp_gathered), D, ws.dqkv.data(), 3 * Dh, D, 3 * Dh,
                ctx.layer_grad(layer_, "wqkv"));
    ws.dtmp.resize(N * D);
    // Reduces over the qkv features: q's, then k's, then v's, each split by heads.
    const float* wqkv = ctx.layer_weight(layer_, "wqkv");
    chained_fold(ctx, 3, stream_output(ctx, ws.dtmp.data()), [&](int first, int count, bool accumulate, RowBlock block) {
      rows_held(ctx, block, [&](int64_t row, int rows) {
        ops::linear_input_grad_strided(ws.dqkv.data() + row * 3 * Dh + first * Dh, 3 * Dh, rows, count * Dh,
                                       wqkv + first * Dh, 3 * Dh, D, ws.dtmp.data() + row * D, D, accumulate);
      });
    });
    const int64_t first = ctx.stream_first;
    float* dattn_in = ws.dtmp.data() + first * D;  // this rank's stream tokens
    const float* norm = ctx.layer_weight(layer_, "attn_norm");
    stream_rows(ctx, StreamOp::kAttnNorm, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::rmsnorm_backward(acts.x.data() + s * D, norm, acts.attn_inv_rms.data() + s, dattn_in + s * D,
                            ws.dh.data() + s * D, count, D, true);
    });
    // The norm's weight gradient folds over every token: their rows from every rank.
    gather_stream_rows_held(ctx, acts.x.data(), D);
    gather_stream_rows_held(ctx, acts.attn_inv_rms.data(), 1);
    gather_stream_rows_held(ctx, dattn_in, D);
    stream_rmsnorm_weight_grad(ctx, acts.x.data(), acts.attn_inv_rms.data(), dattn_in,
                               ctx.layer_grad(layer_, "attn_norm"));
    ctx.trace_tensor("bwd", layer_, "attn_norm", "dh", ws.dh.data(), {N, D}, {TraceRows::kStream});
  }
};

}  // namespace

std::unique_ptr<Block> make_attention_block(int layer) { return std::make_unique<AttentionBlock>(layer); }

}  // namespace ls
