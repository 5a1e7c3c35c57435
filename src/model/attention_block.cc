// The attention block of a layer: RMSNorm, the QKV projection, causal
// multi-head attention, the output projection and the residual add.
// Matches ref::Attention.
#include <string>

#include "contract.h"
#include "model/blocks.h"
#include "ops/attention.h"
#include "ops/ops.h"

namespace ls {

namespace {

class AttentionBlock : public LayerBlock {
 public:
  explicit AttentionBlock(int layer) : LayerBlock(layer, "attention") {}
  bool begins_at_stream() const override { return true; }
  float* stream_in(StepWorkspace& ws) const override { return ws.layers[layer_].x.data(); }

  // x -> mid = x + wo(attention(wqkv(RMSNorm(x)))).
  void forward(StepContext& ctx, StepLosses&) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, H = c.n_heads, S = c.seq_len;
    const int64_t N = ctx.tokens;
    LayerActs& acts = ctx.layer(layer_);
    acts.attn_in.resize(N * D);
    acts.attn_inv_rms.resize(N);
    ops::rmsnorm(acts.x.data(), ctx.layer_weight(layer_, "attn_norm"), acts.attn_in.data(), acts.attn_inv_rms.data(), N,
                 D, c.rms_eps);
    ctx.trace_tensor("fwd", layer_, "attn_norm", "out", acts.attn_in.data(), {N, D});
    acts.qkv.resize(N * 3 * D);
    ops::linear(acts.attn_in.data(), N, D, ctx.layer_weight(layer_, "wqkv"), 3 * D, acts.qkv.data());
    ctx.trace_tensor("fwd", layer_, "qkv", "out", acts.qkv.data(), {N, 3 * D});
    acts.attn_probs.resize((size_t)ctx.batch * H * ops::attention_probs_floats(S));
    acts.attn_out.resize(N * D);
    ops::attention_forward_heads(acts.qkv.data(), ctx.batch, H, S, D / H, scale(c), acts.attn_probs.data(),
                                 acts.attn_out.data());
    ctx.trace_tensor("fwd", layer_, "attention", "out", acts.attn_out.data(), {N, D});
    StepWorkspace& ws = ctx.ws;
    ws.dtmp.resize(N * D);
    ops::linear(acts.attn_out.data(), N, D, ctx.layer_weight(layer_, "wo"), D, ws.dtmp.data());
    ops::add(acts.x.data(), ws.dtmp.data(), acts.mid.data(), N * D);
    ctx.trace_tensor("fwd", layer_, "attn_residual", "h", acts.mid.data(), {N, D});
  }

  // dh: d(mid) in, d(x) out (the residual's part + the norm's).
  void backward(StepContext& ctx) override {
    const ModelConfig& c = ctx.cfg;
    const int D = c.d_model, H = c.n_heads, S = c.seq_len;
    const int64_t N = ctx.tokens;
    StepWorkspace& ws = ctx.ws;
    const LayerActs& acts = ctx.layer(layer_);
    const int64_t* leaf_off = ws.uniform_off.data();
    ops::weight_grad(acts.attn_out.data(), D, ws.dh.data(), D, D, D, leaf_off, ctx.leaves, ctx.layer_grad(layer_, "wo"));
    ws.dattn_out.resize(N * D);
    ops::linear_input_grad(ws.dh.data(), N, D, ctx.layer_weight(layer_, "wo"), D, ws.dattn_out.data(), false);
    ws.dqkv.resize(N * 3 * D);
    ops::attention_backward_heads(acts.qkv.data(), ctx.batch, H, S, D / H, scale(c), acts.attn_probs.data(),
                                  ws.dattn_out.data(), ws.dqkv.data());
    ctx.trace_tensor("bwd", layer_, "attention", "dqkv", ws.dqkv.data(), {N, 3 * D});
    ops::weight_grad(acts.attn_in.data(), D, ws.dqkv.data(), 3 * D, D, 3 * D, leaf_off, ctx.leaves,
                     ctx.layer_grad(layer_, "wqkv"));
    ws.dtmp.resize(N * D);
    ops::linear_input_grad(ws.dqkv.data(), N, 3 * D, ctx.layer_weight(layer_, "wqkv"), D, ws.dtmp.data(), false);
    ops::rmsnorm_weight_grad(acts.x.data(), acts.attn_inv_rms.data(), ws.dtmp.data(), N, D, ctx.leaf_tokens,
                             ctx.layer_grad(layer_, "attn_norm"));
    ops::rmsnorm_backward(acts.x.data(), ctx.layer_weight(layer_, "attn_norm"), acts.attn_inv_rms.data(), ws.dtmp.data(),
                          ws.dh.data(), N, D, true);
    ctx.trace_tensor("bwd", layer_, "attn_norm", "dh", ws.dh.data(), {N, D});
  }

 private:
  static float scale(const ModelConfig& c) { return 1.0f / ls::sqrt((float)(c.d_model / c.n_heads)); }
};

}  // namespace

std::unique_ptr<Block> make_attention_block(int layer) { return std::make_unique<AttentionBlock>(layer); }

}  // namespace ls
