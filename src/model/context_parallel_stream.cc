// Context parallel's residual stream: the embedding, the norms, the residual
// adds, the router, the combine, the dispatch's slot sum and the head run on
// a rank's own positions only. A
// fold over tokens (a weight gradient, the losses' sums) reads every token's
// rows: those are gathered first, and a weight gradient is then split by
// output column, so each column's fold is the whole one, on one rank.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/op_profile.h"
#include "model/context_parallel.h"
#include "ops/ops.h"

namespace ls {

const char* stream_op_name(StreamOp op) {
  static const char* kNames[kStreamOps] = {"embed",        "attn_norm",    "attn_residual",
                                           "moe_norm",     "router",       "moe_combine",
                                           "dispatch_sum", "final_norm",   "head"};
  return kNames[(int)op];
}

void stream_rows(StepContext& ctx, StreamOp op, const std::function<void(int64_t row, int count)>& fn) {
  int64_t& rows = ctx.stats.stream_rows[(size_t)op];
  if (ctx.cp() == 1) {
    rows += ctx.stream_tokens;
    return fn(ctx.stream_first, (int)ctx.stream_tokens);
  }
  const int S = ctx.cfg.seq_len;
  cp_for_each_held(ctx, (int)(ctx.stream_first / S), (int)(ctx.stream_tokens / S), [&](int64_t row, int count) {
    rows += count;
    fn(row, count);
  });
}

void gather_stream_rows_held(StepContext& ctx, float* m, int64_t ld) {
  if (ctx.cp() == 1) return;
  const int S = ctx.cfg.seq_len, D = ctx.cfg.d_model;
  // At most d_model columns at a time (the logits' gradient is vocab wide): the gather's buffers stay row-sized.
  for (int col = 0; col < ld; col += D)
    cp_gather_rows(ctx, m, ld, col, (int)std::min<int64_t>(D, ld - col), (int)(ctx.stream_first / S),
                   (int)(ctx.stream_tokens / S), false, nullptr, ctx.stream_first);
}

void gather_stream_rows_held(StepContext& ctx, int* m, int64_t ld) {
  static_assert(sizeof(int) == sizeof(float), "ints travel as floats' bytes");
  gather_stream_rows_held(ctx, reinterpret_cast<float*>(m), ld);  // only copied (memcpy), never read as floats
}

void gather_slot_rows_held(StepContext& ctx, const LayerActs& acts, float* rows, int64_t width) {
  const int cp = ctx.cp(), S = ctx.cfg.seq_len, K = ctx.cfg.top_k;
  if (cp == 1) return;
  ops::synchronize();
  const int first_sample = (int)(ctx.stream_first / S), samples = (int)(ctx.stream_tokens / S);
  const int64_t each = (int64_t)samples * (S / cp) * K * width;  // every rank holds S / cp positions of a sample
  StepWorkspace& ws = ctx.ws;
  ws.cp_send.resize((size_t)each);
  ws.cp_recv.resize((size_t)(each * cp));
  const int64_t* row_of = acts.row_of.data();
  {
    const OpTimer copying(OpKind::kCopy);
    float* out = ws.cp_send.data();
    cp_for_each_held(ctx, first_sample, samples, [&](int64_t row, int count) {
      ops::copy_rows(rows, row_of + row * K, out, nullptr, (int64_t)count * K, width);
      out += (int64_t)count * K * width;
    });
    ops::synchronize();  // the gather reads what the copies wrote
  }
  all_gather_floats(ctx.group(Axis::kContext), ws.cp_send.data(), ws.cp_recv.data(),
                    std::vector<size_t>((size_t)cp, (size_t)each));
  ctx.stats.cp_bytes_sent += each * (int64_t)sizeof(float) * (cp - 1);
  const OpTimer copying(OpKind::kCopy);
  for (int q = 0; q < cp; ++q) {
    if (q == ctx.cp_rank()) continue;
    const float* in = ws.cp_recv.data() + q * each;
    for (int b = first_sample; b < first_sample + samples; ++b)
      for (const QueryRange& r : cp_query_ranges(S, cp, q, ctx.cp_zigzag())) {
        const int64_t row = (int64_t)b * S + r.first;
        ops::copy_rows(in, nullptr, rows, row_of + row * K, (int64_t)r.count * K, width);
        in += (int64_t)r.count * K * width;
      }
  }
}

void stream_weight_grad(StepContext& ctx, const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                        float* dW, ops::Operands operands) {
  const int64_t* leaf_off = ctx.ws.uniform_off.data();
  if (ctx.cp() == 1) return ops::weight_grad(X, ldx, dY, ldy, in, out, leaf_off, ctx.stream_leaves, dW, operands);
  cp_columns(ctx, out, {{dW, in}}, [&](int first, int count, const std::vector<float*>& parts) {
    ops::weight_grad(X, ldx, dY + first, ldy, in, count, leaf_off, ctx.stream_leaves, parts[0], operands);
  });
}

namespace {

// Columns [first, first + count) of the [n, ld] matrix m, packed into `out`.
void pack_columns(const float* m, int64_t n, int64_t ld, int first, int count, float* out) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * count, m + i * ld + first, sizeof(float) * (size_t)count);
}

}  // namespace

void stream_rmsnorm_weight_grad(StepContext& ctx, const float* x, const float* r, const float* dy, float* dw) {
  const int D = ctx.cfg.d_model;
  const int64_t N = ctx.stream_tokens;
  if (ctx.cp() == 1) return ops::rmsnorm_weight_grad(x, r, dy, N, D, ctx.leaf_tokens, dw);
  // A feature's fold is its own (ops::rmsnorm_weight_grad), so a share of the features folds alone.
  cp_columns(ctx, D, {{dw, 1}}, [&](int first, int count, const std::vector<float*>& parts) {
    ops::synchronize();
    ops::DeviceVector<float>& packed = ctx.ws.cp_pack;
    packed.resize((size_t)(2 * N * count));
    pack_columns(x, N, D, first, count, packed.data());
    pack_columns(dy, N, D, first, count, packed.data() + N * count);
    ops::rmsnorm_weight_grad(packed.data(), r, packed.data() + N * count, N, count, ctx.leaf_tokens, parts[0]);
  });
}

void stream_embedding_grad(StepContext& ctx, const int* tok, const float* dh, float* gtok, float* gpos) {
  const ModelConfig& c = ctx.cfg;
  const int D = c.d_model;
  const int64_t N = ctx.stream_tokens;
  if (ctx.cp() == 1)
    return ops::embedding_grad(tok, dh, N, c.seq_len, D, c.vocab, ctx.leaf_tokens, ctx.stream_leaves, gtok, gpos);
  // A feature's fold is its own: a share of the features folds alone.
  cp_columns(ctx, D, {{gtok, c.vocab}, {gpos, c.seq_len}}, [&](int first, int count, const std::vector<float*>& parts) {
    ops::synchronize();
    ops::DeviceVector<float>& packed = ctx.ws.cp_pack;
    packed.resize((size_t)(N * count));
    pack_columns(dh, N, D, first, count, packed.data());
    ops::embedding_grad(tok, packed.data(), N, c.seq_len, count, c.vocab, ctx.leaf_tokens, ctx.stream_leaves, parts[0],
                        parts[1]);
  });
}

}  // namespace ls
