// The head: final RMSNorm, the output projection to byte logits, softmax
// and the mean cross-entropy over every data-parallel rank's tokens (this
// rank's leaf subtree, then the canonical tree over ranks); then the
// step's total loss. Matches ref::Head.
//
// With tensor parallel alone each TP rank runs the head on its share of
// the tokens (head_rows, model/tensor_parallel.h); the folds over them are
// then joined over the TP group.
#include <string>

#include "model/blocks.h"
#include "model/context_parallel.h"
#include "model/step_sums.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace ls {

namespace {

// Where the head's first row sits in the stream buffers (ws.h, ws.dh): its
// own first token's row when split, else row 0 (they hold its rows only).
int64_t stream_row0(const StepContext& ctx, const StepContext& view) {
  return view.stream_first - ctx.stream_first;
}

class HeadBlock : public Block {
 public:
  std::string name() const override { return "head"; }
  bool begins_at_stream() const override { return true; }
  float* stream_in(StepWorkspace& ws) const override { return ws.h.data(); }

  // Context parallel: every op on this rank's positions; the per-token
  // losses gathered for the fold over tokens.
  void forward(StepContext& whole, StepLosses& losses) override {
    StepContext ctx = head_rows(whole);
    const ModelConfig& c = ctx.cfg;
    const int S = c.seq_len, D = c.d_model, V = c.vocab;
    const int64_t N = ctx.stream_tokens, first = ctx.stream_first;  // the stream's tokens held here
    StepWorkspace& ws = ctx.ws;
    ws.final_out.resize(N * D);
    ws.final_inv_rms.resize(N);
    ws.logits.resize(N * V);
    ws.prob.resize(N * V);
    ws.lse.resize(N);
    ws.loss.resize(N);
    ws.target_id.resize(N);
    const float* h = ws.h.data() + stream_row0(whole, ctx) * D;
    const float* norm = ctx.weight("final_norm");
    stream_rows(ctx, StreamOp::kFinalNorm, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::rmsnorm(h + s * D, norm, ws.final_out.data() + s * D, ws.final_inv_rms.data() + s, count, D,
                   c.rms_eps);
    });
    ctx.trace_tensor("fwd", -1, "final_norm", "out", ws.final_out.data(), {N, D}, {TraceRows::kStream});
    const float* lm_head = ctx.weight("lm_head");
    stream_rows(ctx, StreamOp::kHead, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::linear(ws.final_out.data() + s * D, count, D, lm_head, V, ws.logits.data() + s * V);
      for (int64_t n = row; n < row + count; ++n)
        ws.target_id[n - first] = (int)ctx.token_bytes[(n / S) * (S + 1) + n % S + 1];
      ops::softmax_rows(ws.logits.data() + s * V, V, ws.prob.data() + s * V, V, count, V, 0, ws.lse.data() + s);
      ops::token_losses(ws.lse.data() + s, ws.logits.data() + s * V, ws.target_id.data() + s, count, V,
                        ws.loss.data() + s);
    });
    ctx.trace_tensor("fwd", -1, "lm_head", "logits", ws.logits.data(), {N, V}, {TraceRows::kStream});
    ctx.trace_tensor("fwd", -1, "loss", "per_token", ws.loss.data(), {N}, {TraceRows::kStream});
    gather_stream_rows_held(ctx, ws.loss.data(), 1);
    float ce_sum = ops::token_sum(ws.loss.data(), N, ctx.leaf_tokens);  // this rank's subtree
    join_head_sums(whole, ctx, &ce_sum, 1);
    if (!sum_over_step(ctx, &ce_sum, 1, ws.ce_partial)) return;
    losses.ce = ce_sum / ctx.global_tokens;
    losses.total = total_loss(c, losses);
  }

  // The loss -> dh, the gradient of the head's input stream. Context
  // parallel: the weight gradients over every token's rows, gathered, a
  // share of the columns per rank.
  void backward(StepContext& whole) override {
    StepContext ctx = head_rows(whole);
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, V = c.vocab;
    const int64_t N = ctx.stream_tokens, first = ctx.stream_first;
    StepWorkspace& ws = ctx.ws;
    ws.dlogits.resize(N * V);
    ws.dtmp.resize(N * D);
    ws.dh.resize(whole.stream_tokens * D);
    const int64_t row0 = stream_row0(whole, ctx);
    const float* h = ws.h.data() + row0 * D;
    float* dh = ws.dh.data() + row0 * D;
    const float* lm_head = ctx.weight("lm_head");
    stream_rows(ctx, StreamOp::kHead, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::cross_entropy_grad(ws.prob.data() + s * V, ws.target_id.data() + s, count, V, ctx.global_tokens,
                              ws.dlogits.data() + s * V);
    });
    ctx.trace_tensor("bwd", -1, "lm_head", "dlogits", ws.dlogits.data(), {N, V}, {TraceRows::kStream});
    gather_stream_rows_held(ctx, ws.final_out.data(), D);
    gather_stream_rows_held(ctx, ws.dlogits.data(), V);
    stream_weight_grad(ctx, ws.final_out.data(), D, ws.dlogits.data(), V, D, V, ctx.grad("lm_head"));
    const float* norm = ctx.weight("final_norm");
    stream_rows(ctx, StreamOp::kFinalNorm, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::linear_input_grad(ws.dlogits.data() + s * V, count, V, lm_head, D, ws.dtmp.data() + s * D, false);
      ops::rmsnorm_backward(h + s * D, norm, ws.final_inv_rms.data() + s, ws.dtmp.data() + s * D, dh + s * D, count,
                            D, false);
    });
    gather_stream_rows_held(ctx, ws.h.data(), D);
    gather_stream_rows_held(ctx, ws.final_inv_rms.data(), 1);
    gather_stream_rows_held(ctx, ws.dtmp.data(), D);
    stream_rmsnorm_weight_grad(ctx, h, ws.final_inv_rms.data(), ws.dtmp.data(), ctx.grad("final_norm"));
    join_head_sums(whole, ctx, ctx.grad("lm_head"), (size_t)V * D);
    join_head_sums(whole, ctx, ctx.grad("final_norm"), (size_t)D);
    join_head_rows(whole, ctx, ws.dh.data(), D);
    whole.trace_tensor("bwd", -1, "final_norm", "dh", ws.dh.data(), {whole.stream_tokens, D}, {TraceRows::kStream});
  }
};

}  // namespace

std::unique_ptr<Block> make_head_block() { return std::make_unique<HeadBlock>(); }

}  // namespace ls
