// The embedding block: h[n] = tok_emb[byte of token n] + pos_emb[n mod seq_len].
// Backward: the embeddings' gradients, per leaf the tokens' dh in token
// order, leaves by the canonical tree (ops::embedding_grad). Matches
// ref::Embedding.
#include <string>

#include "model/blocks.h"
#include "model/context_parallel.h"
#include "ops/ops.h"

namespace ls {

namespace {

class EmbeddingBlock : public Block {
 public:
  std::string name() const override { return "embedding"; }

  void forward(StepContext& ctx, StepLosses&) override {
    const int S = ctx.cfg.seq_len, D = ctx.cfg.d_model;
    // The stream's tokens held here (sequence parallel: whole samples of a TP rank's share).
    const int64_t N = ctx.stream_tokens, first = ctx.stream_first;
    StepWorkspace& ws = ctx.ws;
    ws.tok_id.resize(N);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t n = first + i;
      ws.tok_id[i] = (int)ctx.token_bytes[(n / S) * (S + 1) + n % S];
    }
    // Context parallel: this rank's positions (a range inside one sample, so its positions are the table's from p).
    stream_rows(ctx, StreamOp::kEmbed, [&](int64_t row, int count) {
      const int64_t s = row - first;
      ops::embed(ws.tok_id.data() + s, ctx.weight("tok_emb"), ctx.weight("pos_emb") + (row % S) * D,
                 ctx.stream(0) + s * D, count, S, D);
    });
  }

  // Context parallel: every token's dh gathered, the gradients split by feature.
  void backward(StepContext& ctx) override {
    gather_stream_rows_held(ctx, ctx.ws.dh.data(), ctx.cfg.d_model);
    stream_embedding_grad(ctx, ctx.ws.tok_id.data(), ctx.ws.dh.data(), ctx.grad("tok_emb"), ctx.grad("pos_emb"));
  }
};

}  // namespace

std::unique_ptr<Block> make_embedding_block() { return std::make_unique<EmbeddingBlock>(); }

}  // namespace ls
