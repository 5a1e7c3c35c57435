// The head: final RMSNorm, the output projection to byte logits, softmax
// and the mean cross-entropy over every data-parallel rank's tokens (this
// rank's leaf subtree, then the canonical tree over ranks); then the
// step's total loss. Matches ref::Head.
#include <string>

#include "model/blocks.h"
#include "ops/ops.h"

namespace ls {

namespace {

class HeadBlock : public Block {
 public:
  std::string name() const override { return "head"; }
  bool begins_at_stream() const override { return true; }
  float* stream_in(StepWorkspace& ws) const override { return ws.h.data(); }

  void forward(StepContext& ctx, StepLosses& losses) override {
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
    ops::rmsnorm(ws.h.data(), ctx.weight("final_norm"), ws.final_out.data(), ws.final_inv_rms.data(), N, D, c.rms_eps);
    ctx.trace_tensor("fwd", -1, "final_norm", "out", ws.final_out.data(), {N, D}, {TraceRows::kStream});
    ops::linear(ws.final_out.data(), N, D, ctx.weight("lm_head"), V, ws.logits.data());
    ctx.trace_tensor("fwd", -1, "lm_head", "logits", ws.logits.data(), {N, V}, {TraceRows::kStream});
    ws.target_id.resize(N);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t n = first + i;
      ws.target_id[i] = (int)ctx.token_bytes[(n / S) * (S + 1) + n % S + 1];
    }
    ops::softmax_rows(ws.logits.data(), V, ws.prob.data(), V, (int)N, V, 0, ws.lse.data());
    ops::token_losses(ws.lse.data(), ws.logits.data(), ws.target_id.data(), N, V, ws.loss.data());
    ctx.trace_tensor("fwd", -1, "loss", "per_token", ws.loss.data(), {N}, {TraceRows::kStream});
    float ce_sum = ops::token_sum(ws.loss.data(), N, ctx.leaf_tokens);  // this rank's subtree
    if (ctx.microbatches > 0) {  // a pipeline combines the microbatches' sums
      ws.ce_partial = ce_sum;
      return;
    }
    ctx.mesh->stream_group().all_reduce_sum(&ce_sum, 1);
    losses.ce = ce_sum / ctx.global_tokens;
    losses.total = total_loss(c, losses);
  }

  // The loss -> dh, the gradient of the head's input stream.
  void backward(StepContext& ctx) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, V = c.vocab;
    const int64_t N = ctx.stream_tokens;
    StepWorkspace& ws = ctx.ws;
    ws.dlogits.resize(N * V);
    ops::cross_entropy_grad(ws.prob.data(), ws.target_id.data(), N, V, ctx.global_tokens, ws.dlogits.data());
    ctx.trace_tensor("bwd", -1, "lm_head", "dlogits", ws.dlogits.data(), {N, V}, {TraceRows::kStream});
    ops::weight_grad(ws.final_out.data(), D, ws.dlogits.data(), V, D, V, ws.uniform_off.data(), ctx.stream_leaves,
                     ctx.grad("lm_head"));
    ws.dtmp.resize(N * D);
    ws.dh.resize(N * D);
    ops::linear_input_grad(ws.dlogits.data(), N, V, ctx.weight("lm_head"), D, ws.dtmp.data(), false);
    ops::rmsnorm_weight_grad(ws.h.data(), ws.final_inv_rms.data(), ws.dtmp.data(), N, D, ctx.leaf_tokens,
                             ctx.grad("final_norm"));
    ops::rmsnorm_backward(ws.h.data(), ctx.weight("final_norm"), ws.final_inv_rms.data(), ws.dtmp.data(), ws.dh.data(),
                          N, D, false);
    ctx.trace_tensor("bwd", -1, "final_norm", "dh", ws.dh.data(), {N, D}, {TraceRows::kStream});
  }
};

}  // namespace

std::unique_ptr<Block> make_head_block() { return std::make_unique<HeadBlock>(); }

}  // namespace ls
