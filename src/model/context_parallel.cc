#include "model/context_parallel.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include <omp.h>

#include "contract.h"
#include "ops/attention.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace ls {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// rows [first, first + count) of sample b, columns [col, col + width) of a
// [N, ld] matrix, to or from a packed buffer.
void pack_rows(const float* m, int64_t ld, int64_t row0, int count, int col, int width, float*& out) {
  for (int i = 0; i < count; ++i) {
    std::memcpy(out, m + (row0 + i) * ld + col, sizeof(float) * (size_t)width);
    out += width;
  }
}
void unpack_rows(float* m, int64_t ld, int64_t row0, int count, int col, int width, const float*& in) {
  for (int i = 0; i < count; ++i) {
    std::memcpy(m + (row0 + i) * ld + col, in, sizeof(float) * (size_t)width);
    in += width;
  }
}

// Where range i of `ranges` keeps its P in a (sample, head)'s share: after
// the earlier ranges'. probs_offset(ranges, ranges.size()) is the share's size.
int64_t probs_offset(const std::vector<QueryRange>& ranges, size_t i) {
  int64_t n = 0;
  for (size_t k = 0; k < i; ++k) n += ops::attention_range_probs_floats(ranges[k].count, ranges[k].first);
  return n;
}

// 1 / sqrt(head dimension): the attention logits' scale.
float attention_scale(const ModelConfig& c) { return 1.0f / ls::sqrt((float)(c.d_model / c.n_heads)); }

}  // namespace

CpBusy::CpBusy(StepContext& ctx) : ctx_(ctx), t0_(now_seconds()) {}
CpBusy::~CpBusy() {
  ops::synchronize();  // a kernel backend: the busy time is the kernels'
  ctx_.stats.cp_attention_seconds += now_seconds() - t0_;
}

void cp_for_each_held(const StepContext& ctx, int first_sample, int samples,
                      const std::function<void(int64_t row, int count)>& fn) {
  const int S = ctx.cfg.seq_len;
  const std::vector<QueryRange> mine = cp_query_ranges(S, ctx.cp(), ctx.cp_rank(), ctx.cp_zigzag());
  for (int b = first_sample; b < first_sample + samples; ++b)
    for (const QueryRange& r : mine) fn((int64_t)b * S + r.first, r.count);
}

void rows_held_untimed(const StepContext& ctx, const std::function<void(int64_t row, int count)>& fn) {
  if (ctx.cp() == 1) return fn(0, (int)ctx.tokens);
  cp_for_each_held(ctx, 0, ctx.batch, fn);
}

void rows_held(StepContext& ctx, const std::function<void(int64_t row, int count)>& fn) {
  rows_held(ctx, RowBlock{0, ctx.tokens}, fn);
}

void rows_held_untimed(const StepContext& ctx, RowBlock block, const std::function<void(int64_t row, int count)>& fn) {
  const int64_t end = block.first + block.count;
  rows_held_untimed(ctx, [&](int64_t row, int count) {
    const int64_t lo = std::max(row, block.first), hi = std::min(row + count, end);
    if (lo < hi) fn(lo, (int)(hi - lo));
  });
}

void rows_held(StepContext& ctx, RowBlock block, const std::function<void(int64_t row, int count)>& fn) {
  if (ctx.cp() == 1) return fn(block.first, (int)block.count);
  CpBusy busy(ctx);
  rows_held_untimed(ctx, block, fn);
}

const float* rows_held_of_stream(StepContext& ctx, const float* stream, ops::DeviceVector<float>& gathered,
                                 bool busy, const RowsHeldOf& fn) {
  if (ctx.cp() == 1)
    return every_token_rows(ctx, stream, gathered,
                            [&](const float* x, int64_t first, int64_t count) { fn(x, first, (int)count); });
  const float* all = every_token(ctx, stream, gathered);
  const int64_t D = ctx.cfg.d_model;
  const auto rows = [&](int64_t row, int count) { fn(all + row * D, row, count); };
  if (busy) rows_held(ctx, rows);
  else rows_held_untimed(ctx, rows);
  return all;
}

void gather_rows_held(StepContext& ctx, float* m, int64_t ld) {
  if (ctx.cp() > 1) cp_gather_rows(ctx, m, ld, 0, (int)ld, 0, ctx.batch);
}

namespace {

// Context parallel: acts.qkv's q, k and v of this rank's positions, and
// every token's k and v gathered. With mesh.overlap k and v are projected
// first and their all-gather is in flight while q is (each column's fold
// is its own, so the order changes no bit).
void cp_project_qkv(StepContext& ctx, const float* attn_in, const float* wqkv, LayerActs& acts) {
  const int D = ctx.cfg.d_model, Dh = ctx.width_held();
  float* qkv = acts.qkv.data();
  if (!ctx.mesh->overlap()) {
    rows_held_of_stream(ctx, attn_in, ctx.ws.sp_gathered, true, [&](const float* x, int64_t row, int count) {
      ops::linear(x, count, D, wqkv, 3 * Dh, qkv + row * 3 * Dh);
    });
    return cp_gather_rows(ctx, qkv, 3 * Dh, Dh, 2 * Dh, 0, ctx.batch, /*kv=*/true);
  }
  const auto project_kv = [&](const float* x, int64_t row, int count) {
    ops::linear_strided(x, D, count, D, wqkv + Dh, 3 * Dh, 2 * Dh, qkv + row * 3 * Dh + Dh, 3 * Dh, false);
  };
  const float* x_all = rows_held_of_stream(ctx, attn_in, ctx.ws.sp_gathered, true, project_kv);
  // Q in pieces of at most 256 rows, the gather progressed between them (MPI moves data only inside its calls).
  cp_gather_rows(ctx, qkv, 3 * Dh, Dh, 2 * Dh, 0, ctx.batch, /*kv=*/true, [&](const std::function<void()>& progress) {
    rows_held(ctx, [&](int64_t row, int count) {
      for (int at = 0; at < count; at += 256) {
        const int rows = std::min(256, count - at);
        ops::linear_strided(x_all + (row + at) * D, D, rows, D, wqkv, 3 * Dh, Dh, qkv + (row + at) * 3 * Dh, 3 * Dh,
                            false);
        progress();
      }
    });
  });
}

}  // namespace

bool probs_as_bf16() { return bf16_matmuls() && !ops::installed_kernels(); }

ops::ProbsStore probs_store(LayerActs& acts, int64_t entries) {
  if (probs_as_bf16()) {
    acts.attn_probs_bf16.resize((size_t)entries);
    return {nullptr, acts.attn_probs_bf16.data()};
  }
  acts.attn_probs.resize((size_t)entries);
  return {acts.attn_probs.data(), nullptr};
}

ops::ProbsView probs_kept(const LayerActs& acts) {
  if (probs_as_bf16()) return {nullptr, acts.attn_probs_bf16.data()};
  return {acts.attn_probs.data(), nullptr};
}

void attention_forward_held(StepContext& ctx, int layer, const float* attn_in, const float* wqkv, LayerActs& acts) {
  const ModelConfig& c = ctx.cfg;
  const int D = c.d_model, S = c.seq_len, Dh = ctx.width_held(), Hh = ctx.heads_held(), hd = D / c.n_heads;
  const int64_t N = ctx.tokens;
  const float scale = attention_scale(c);
  if (ctx.cp() > 1) {  // this rank's positions' queries against every token's K and V
    cp_project_qkv(ctx, attn_in, wqkv, acts);
    ctx.trace_tensor("fwd", layer, "qkv", "out", acts.qkv.data(), {N, 3 * D}, {TraceRows::kHeld, 3});
    const ops::ProbsStore P =
        probs_store(acts, (int64_t)ctx.batch * Hh * cp_probs_floats(S, ctx.cp(), ctx.cp_rank(), ctx.cp_zigzag()));
    cp_attention_forward(ctx, acts.qkv.data(), Hh, hd, scale, P, acts.attn_out.data());
    ctx.trace_tensor("fwd", layer, "attention", "out", acts.attn_out.data(), {N, D}, {TraceRows::kHeld, 1});
    return;
  }
  rows_held_of_stream(ctx, attn_in, ctx.ws.sp_gathered, true, [&](const float* x, int64_t row, int count) {
    ops::linear(x, count, D, wqkv, 3 * Dh, acts.qkv.data() + row * 3 * Dh);
  });
  ctx.trace_tensor("fwd", layer, "qkv", "out", acts.qkv.data(), {N, 3 * D}, {TraceRows::kTokens, 3});
  ops::attention_forward_heads(acts.qkv.data(), ctx.batch, Hh, S, hd, scale,
                               probs_store(acts, (int64_t)ctx.batch * Hh * ops::attention_probs_floats(S)),
                               acts.attn_out.data());
  ctx.trace_tensor("fwd", layer, "attention", "out", acts.attn_out.data(), {N, D}, {TraceRows::kTokens, 1});
}

void attention_backward_held(StepContext& ctx, const LayerActs& acts, const float* dattn_out, float* dqkv) {
  const ModelConfig& c = ctx.cfg;
  const int hd = c.d_model / c.n_heads, Hh = ctx.heads_held();
  if (ctx.cp() > 1)
    return cp_attention_backward(ctx, acts.qkv.data(), Hh, hd, attention_scale(c), probs_kept(acts), dattn_out,
                                 dqkv);
  ops::attention_backward_heads(acts.qkv.data(), ctx.batch, Hh, c.seq_len, hd, attention_scale(c), probs_kept(acts),
                                dattn_out, dqkv);
}

void token_weight_grad(StepContext& ctx, const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                       float* dW) {
  if (ctx.cp() > 1) return cp_weight_grad(ctx, X, ldx, dY, ldy, in, out, dW);
  ops::weight_grad(X, ldx, dY, ldy, in, out, ctx.ws.uniform_off.data(), ctx.leaves, dW);
}

void cp_gather_rows(StepContext& ctx, float* m, int64_t ld, int col, int width, int first_sample, int samples,
                    bool kv, const InFlightWork& while_in_flight, int64_t m_first_row) {
  ops::synchronize();  // the host packs and unpacks what kernels wrote
  const int S = ctx.cfg.seq_len, cp = ctx.cp();
  const bool zz = ctx.cp_zigzag();
  const int64_t each = (int64_t)samples * (S / cp) * width;  // every rank holds S / cp positions of a sample
  ctx.ws.cp_send.resize((size_t)each);
  ctx.ws.cp_recv.resize((size_t)(each * cp));
  float* out = ctx.ws.cp_send.data();
  cp_for_each_held(ctx, first_sample, samples,
                   [&](int64_t row, int count) { pack_rows(m, ld, row - m_first_row, count, col, width, out); });
  Communicator& group = ctx.group(Axis::kContext);
  const std::vector<size_t> bytes((size_t)cp, sizeof(float) * (size_t)each);
  if (while_in_flight) {
    Pending gathering = group.start_all_gather(ctx.ws.cp_send.data(), ctx.ws.cp_recv.data(), bytes);
    while_in_flight([&] { gathering->test(); });
    gathering->wait();
  } else {
    group.all_gather(ctx.ws.cp_send.data(), ctx.ws.cp_recv.data(), bytes);
  }
  const int64_t sent = each * (int64_t)sizeof(float) * (cp - 1);
  ctx.stats.cp_bytes_sent += sent;
  if (kv) ctx.stats.cp_kv_bytes_sent += sent;
  for (int q = 0; q < cp; ++q) {
    if (q == ctx.cp_rank()) continue;
    const float* in = ctx.ws.cp_recv.data() + q * each;
    const std::vector<QueryRange> held = cp_query_ranges(S, cp, q, zz);
    for (int b = first_sample; b < first_sample + samples; ++b)
      for (const QueryRange& r : held)
        unpack_rows(m, ld, (int64_t)b * S + r.first - m_first_row, r.count, col, width, in);
  }
}

CpShare cp_share(int n, int cp, int rank) {
  const int each = (n + cp - 1) / cp;
  const int first = std::min(n, rank * each);
  return {first, std::min(n, first + each) - first};
}

void cp_weight_grad(StepContext& ctx, const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                    float* dW) {
  cp_columns(ctx, out, {{dW, in}}, [&](int first, int count, const std::vector<float*>& parts) {
    CpBusy busy(ctx);
    ops::weight_grad(X, ldx, dY + first, ldy, in, count, ctx.ws.uniform_off.data(), ctx.leaves, parts[0]);
  });
}

void cp_columns(StepContext& ctx, int cols, const std::vector<ColumnsOut>& outs,
                const std::function<void(int first, int count, const std::vector<float*>& parts)>& fn) {
  const int cp = ctx.cp();
  const CpShare mine = cp_share(cols, cp, ctx.cp_rank());
  const int widest = cp_share(cols, cp, 0).count;  // rank 0 holds the most columns
  int64_t rows = 0;
  for (const ColumnsOut& o : outs) rows += o.rows;
  const int64_t each = rows * widest;
  ctx.ws.cp_send.resize((size_t)each);
  ctx.ws.cp_recv.resize((size_t)(each * cp));
  if (mine.count > 0) {
    std::vector<float*> parts;
    float* at = ctx.ws.cp_send.data();
    for (const ColumnsOut& o : outs) {
      parts.push_back(at);
      at += o.rows * mine.count;
    }
    fn(mine.first, mine.count, parts);
  }
  ops::synchronize();
  all_gather_floats(ctx.group(Axis::kContext), ctx.ws.cp_send.data(), ctx.ws.cp_recv.data(),
                    std::vector<size_t>((size_t)cp, (size_t)each));
  ctx.stats.cp_bytes_sent += each * (int64_t)sizeof(float) * (cp - 1);
  for (int q = 0; q < cp; ++q) {  // rank q's [rows, its columns] of each, packed, into place
    const CpShare theirs = cp_share(cols, cp, q);
    const float* slice = ctx.ws.cp_recv.data() + q * each;
    for (const ColumnsOut& o : outs) {
      for (int64_t i = 0; i < o.rows && theirs.count > 0; ++i)
        std::memcpy(o.data + i * cols + theirs.first, slice + i * theirs.count, sizeof(float) * (size_t)theirs.count);
      slice += o.rows * theirs.count;
    }
  }
}

std::vector<QueryRange> cp_query_ranges(int S, int cp, int rank, bool zigzag) {
  const int chunks = zigzag ? 2 * cp : cp;
  if (cp < 1 || rank < 0 || rank >= cp || S % chunks != 0)
    throw std::invalid_argument("context parallel: " + std::to_string(S) + " positions do not cut into " +
                                std::to_string(chunks) + " equal chunks");
  const int C = S / chunks;
  if (!zigzag) return {{rank * C, C}};
  return {{rank * C, C}, {(2 * cp - 1 - rank) * C, C}};
}

std::vector<ChainLink> cp_chain(int S, int cp, bool zigzag) {
  std::vector<ChainLink> links;
  for (int r = 0; r < cp; ++r)
    for (const QueryRange& q : cp_query_ranges(S, cp, r, zigzag)) links.push_back({q, r});
  std::sort(links.begin(), links.end(), [](const ChainLink& a, const ChainLink& b) { return a.range.first < b.range.first; });
  return links;
}

int cp_chain_key_block(int S, int cp) { return std::max(16, S / (8 * cp) / 16 * 16); }

int64_t cp_probs_floats(int S, int cp, int rank, bool zigzag) {
  const std::vector<QueryRange> ranges = cp_query_ranges(S, cp, rank, zigzag);
  return probs_offset(ranges, ranges.size());
}

void cp_attention_forward(StepContext& ctx, const float* qkv, int heads, int hd, float scale, ops::ProbsStore P,
                          float* attn_out) {
  const int S = ctx.cfg.seq_len;
  const bool zz = ctx.cp_zigzag();
  const std::vector<QueryRange> ranges = cp_query_ranges(S, ctx.cp(), ctx.cp_rank(), zz);
  const int64_t per_head = probs_offset(ranges, ranges.size());
  CpBusy busy(ctx);
  for (size_t i = 0; i < ranges.size(); ++i)
    ops::attention_forward_range_heads(qkv, ctx.batch, heads, S, hd, scale, ranges[i].first, ranges[i].count, P,
                                       per_head, probs_offset(ranges, i), attn_out);
}

namespace {

// One of this rank's links of the chain: its query range, where its P starts
// in a (sample, head)'s share of per_head floats, and the ranks of the links
// before and after it when they are another rank's (else -1).
struct MyLink {
  QueryRange range;
  int64_t p_off = 0, per_head = 0;
  int from = -1, to = -1;
};

// fn(MyLink) for this rank's links in ascending position.
template <class Fn>
void for_each_my_link(const StepContext& ctx, Fn&& fn) {
  const int S = ctx.cfg.seq_len, me = ctx.cp_rank();
  const std::vector<QueryRange> ranges = cp_query_ranges(S, ctx.cp(), me, ctx.cp_zigzag());
  const std::vector<ChainLink> chain = cp_chain(S, ctx.cp(), ctx.cp_zigzag());
  for (size_t k = 0; k < chain.size(); ++k) {
    if (chain[k].rank != me) continue;
    size_t mine = 0;  // which of my ranges
    while (ranges[mine].first != chain[k].range.first) ++mine;
    MyLink l;
    l.range = chain[k].range;
    l.p_off = probs_offset(ranges, mine);
    l.per_head = probs_offset(ranges, ranges.size());
    if (k > 0 && chain[k - 1].rank != me) l.from = chain[k - 1].rank;
    if (k + 1 < chain.size() && chain[k + 1].rank != me) l.to = chain[k + 1].rank;
    fn(l);
  }
}

// The chain of a sample's dK, dV folds, a whole link at a time: receive the
// keys [0, first) from the previous link's rank, run the range's backward,
// send the keys [0, end) on. Kernel backends (one launch per link).
void chain_whole_links(StepContext& ctx, const float* qkv, int heads, int hd, float scale, ops::ProbsView P,
                       const float* dattn_out, float* dqkv) {
  const int S = ctx.cfg.seq_len, Dh = heads * hd;
  const int64_t ld = 3 * (int64_t)Dh;
  ops::DeviceVector<float>& link = ctx.ws.cp_link;
  // For each link, every sample in turn, so the next rank starts on sample 0 while this one works on sample 1.
  for_each_my_link(ctx, [&](const MyLink& l) {
    const QueryRange r = l.range;
    const bool continues = r.first > 0;  // only the chain's first link starts from +0
    for (int b = 0; b < ctx.batch; ++b) {
      const int64_t row0 = (int64_t)b * S;
      if (l.from >= 0) {  // the partial dK, dV of keys [0, r.first)
        ops::synchronize();  // the host rewrites rows kernels may still touch
        link.resize((size_t)r.first * 2 * Dh);
        ctx.group(Axis::kContext).recv(link.data(), sizeof(float) * (link.size()), l.from);
        const float* in = link.data();
        unpack_rows(dqkv, ld, row0, r.first, Dh, 2 * Dh, in);
      }
      {
        CpBusy busy(ctx);
        ops::attention_backward_range_heads(qkv, b, heads, S, hd, scale, r.first, r.count, P, l.per_head, l.p_off,
                                            dattn_out, dqkv, continues);
      }
      if (l.to >= 0) {  // keys [0, end) go on
        const int end = r.first + r.count;
        link.resize((size_t)end * 2 * Dh);
        float* out = link.data();
        pack_rows(dqkv, ld, row0, end, Dh, 2 * Dh, out);
        ctx.group(Axis::kContext).send(link.data(), sizeof(float) * (link.size()), l.to);
        ctx.stats.cp_bytes_sent += (int64_t)link.size() * (int64_t)sizeof(float);
        ctx.stats.cp_kv_bytes_sent += (int64_t)link.size() * (int64_t)sizeof(float);
        ++ctx.stats.cp_link_messages;
      }
    }
  });
}

// The same chain pipelined over key blocks (the engine's ops). Per link and
// sample, a group of heads at a time (as many as the rank has threads, so a
// group's dS stays in cache): first dS and dq (they read no partial: this
// overlaps the previous link's rank still folding), then dK, dV a key block
// at a time, each block received from the previous link's rank just before
// it is continued and sent on as soon as it is done, so the next rank works
// on block i while this one works on block i + 1, inside one sample too.
// Each key's fold runs over the queries in ascending order as in the
// whole-link chain: the same bits.
void chain_key_blocks(StepContext& ctx, const float* qkv, int heads, int hd, float scale, ops::ProbsView P,
                      const float* dattn_out, float* dqkv) {
  const int S = ctx.cfg.seq_len, Dh = heads * hd, kb = cp_chain_key_block(S, ctx.cp());
  const int group = std::max(1, std::min(heads, omp_get_max_threads()));
  const int64_t ld = 3 * (int64_t)Dh;
  ops::DeviceVector<float>& ds = ctx.ws.cp_ds;  // one (link, sample, head group)'s dS
  ops::DeviceVector<float>& link = ctx.ws.cp_link;
  for_each_my_link(ctx, [&](const MyLink& l) {
    const QueryRange r = l.range;
    const int end = r.first + r.count;
    ds.resize((size_t)(group * ops::attention_range_probs_floats(r.count, r.first)));
    for (int b = 0; b < ctx.batch; ++b)
      for (int h0 = 0; h0 < heads; h0 += group) {
        const int h1 = std::min(heads, h0 + group), w = (h1 - h0) * hd;  // the group's K (and V) columns
        const int64_t row0 = (int64_t)b * S;
        {
          CpBusy busy(ctx);
          ops::attention_backward_range_dq_heads(qkv, b, heads, h0, h1, S, hd, scale, r.first, r.count, P,
                                                 l.per_head, l.p_off, dattn_out, ds.data(), dqkv);
        }
        for (int u0 = 0; u0 < end; u0 += kb) {
          const int u1 = std::min(end, u0 + kb);
          if (l.from >= 0 && u0 < r.first) {  // the previous link's partial of keys [u0, min(u1, first))
            const int n = std::min(u1, r.first) - u0;
            link.resize((size_t)n * 2 * w);
            ctx.group(Axis::kContext).recv(link.data(), sizeof(float) * link.size(), l.from);
            const float* in = link.data();
            unpack_rows(dqkv, ld, row0 + u0, n, Dh + h0 * hd, w, in);
            unpack_rows(dqkv, ld, row0 + u0, n, 2 * Dh + h0 * hd, w, in);
          }
          {
            CpBusy busy(ctx);
            ops::attention_backward_range_dkv_heads(qkv, b, heads, h0, h1, S, hd, r.first, r.count, P, l.per_head,
                                                    l.p_off, ds.data(), dattn_out, dqkv, u0, u1);
          }
          if (l.to >= 0) {  // keys [u0, u1) go on
            link.resize((size_t)(u1 - u0) * 2 * w);
            float* out = link.data();
            pack_rows(dqkv, ld, row0 + u0, u1 - u0, Dh + h0 * hd, w, out);
            pack_rows(dqkv, ld, row0 + u0, u1 - u0, 2 * Dh + h0 * hd, w, out);
            ctx.group(Axis::kContext).send(link.data(), sizeof(float) * link.size(), l.to);
            ctx.stats.cp_bytes_sent += (int64_t)link.size() * (int64_t)sizeof(float);
            ctx.stats.cp_kv_bytes_sent += (int64_t)link.size() * (int64_t)sizeof(float);
            ++ctx.stats.cp_link_messages;
          }
        }
      }
  });
}

// numerics.level=local, the usual way: each rank folds dK, dV over its own
// queries from +0 (its ranges in ascending order), and the group's partials
// are summed by an all-reduce in the library's order, so every rank holds
// every key's dK, dV. Its bits move with mesh.cp.
void local_partials_summed(StepContext& ctx, const float* qkv, int heads, int hd, float scale, ops::ProbsView P,
                           const float* dattn_out, float* dqkv) {
  const int S = ctx.cfg.seq_len, Dh = heads * hd;
  const int64_t ld = 3 * (int64_t)Dh, rows = (int64_t)ctx.batch * S;
  const std::vector<QueryRange> ranges = cp_query_ranges(S, ctx.cp(), ctx.cp_rank(), ctx.cp_zigzag());
  const int64_t per_head = probs_offset(ranges, ranges.size());
  {
    CpBusy busy(ctx);
    for (int b = 0; b < ctx.batch; ++b)
      for (size_t i = 0; i < ranges.size(); ++i)
        ops::attention_backward_range_heads(qkv, b, heads, S, hd, scale, ranges[i].first, ranges[i].count, P,
                                            per_head, probs_offset(ranges, i), dattn_out, dqkv, i > 0);
  }
  ops::DeviceVector<float>& sums = ctx.ws.cp_send;
  sums.resize((size_t)(rows * 2 * Dh));
  float* out = sums.data();
  pack_rows(dqkv, ld, 0, (int)rows, Dh, 2 * Dh, out);
  ctx.group(Axis::kContext).all_reduce_sum(sums.data(), sums.size());
  const float* in = sums.data();
  unpack_rows(dqkv, ld, 0, (int)rows, Dh, 2 * Dh, in);
  const int64_t sent = (int64_t)all_reduce_bytes_sent(sums.size(), sizeof(float), ctx.cp());
  ctx.stats.cp_bytes_sent += sent;
  ctx.stats.cp_kv_bytes_sent += sent;
}

}  // namespace

void cp_attention_backward(StepContext& ctx, const float* qkv, int heads, int hd, float scale, ops::ProbsView P,
                           const float* dattn_out, float* dqkv) {
  const int S = ctx.cfg.seq_len, Dh = heads * hd;
  const int64_t ld = 3 * (int64_t)Dh;
  const bool zz = ctx.cp_zigzag();
  const std::vector<ChainLink> chain = cp_chain(S, ctx.cp(), zz);
  // A key's row takes its first term in the range that holds it: +0 until then.
  ops::fill(dqkv, ctx.tokens * ld, 0.0f);
  if (local_numerics()) {
    local_partials_summed(ctx, qkv, heads, hd, scale, P, dattn_out, dqkv);
    return cp_gather_rows(ctx, dqkv, ld, 0, Dh, 0, ctx.batch);  // every rank's dq rows
  }
  // Key blocks where the samples alone cannot fill the chain (fewer than 2 cp of them: the next rank would idle
  // for a link's share of a sample); with more, the samples pipeline it and whole links send fewer messages.
  if (ops::installed_kernels() || ctx.batch >= 2 * ctx.cp()) chain_whole_links(ctx, qkv, heads, hd, scale, P, dattn_out, dqkv);
  else chain_key_blocks(ctx, qkv, heads, hd, scale, P, dattn_out, dqkv);
  // The finished dK, dV are on the last link's rank. Rank q gets what it
  // reads: its own rows whole (its input gradient) and every row's columns
  // of its wqkv weight-gradient share. Then every rank's dq rows.
  ops::synchronize();
  const int last = chain.back().rank;
  // Rank q's part: per position, the columns it reads (all of dK, dV on its
  // own positions; else its share's, within dK, dV), every sample alike.
  struct Part {
    std::vector<char> held;
    int k0 = 0, k1 = 0;
    size_t floats = 0;
  };
  auto part_of = [&](int q) {
    Part p;
    p.held.assign((size_t)S, 0);
    for (const QueryRange& r : cp_query_ranges(S, ctx.cp(), q, zz)) std::fill_n(p.held.begin() + r.first, r.count, 1);
    const CpShare share = cp_share(3 * Dh, ctx.cp(), q);
    p.k0 = std::max(Dh, share.first);
    p.k1 = std::max(Dh, share.first + share.count);
    for (int t = 0; t < S; ++t) p.floats += (size_t)(p.held[t] ? 2 * Dh : p.k1 - p.k0) * ctx.batch;
    return p;
  };
  auto walk = [&](const Part& p, const std::function<void(float* row, int width)>& fn) {  // in packing order
    for (int b = 0; b < ctx.batch; ++b)
      for (int t = 0; t < S; ++t)
        fn(dqkv + ((int64_t)b * S + t) * ld + (p.held[t] ? Dh : p.k0), p.held[t] ? 2 * Dh : p.k1 - p.k0);
  };
  if (ctx.cp_rank() == last) {
    for (int q = 0; q < ctx.cp(); ++q) {
      if (q == last) continue;
      const Part p = part_of(q);
      ctx.ws.cp_send.resize(p.floats);
      float* out = ctx.ws.cp_send.data();
      walk(p, [&](float* row, int width) {
        std::memcpy(out, row, sizeof(float) * (size_t)width);
        out += width;
      });
      ctx.group(Axis::kContext).send(ctx.ws.cp_send.data(), sizeof(float) * (p.floats), q);
      const int64_t sent = (int64_t)(p.floats * sizeof(float));
      ctx.stats.cp_bytes_sent += sent;
      ctx.stats.cp_kv_bytes_sent += sent;
    }
  } else {
    const Part p = part_of(ctx.cp_rank());
    ctx.ws.cp_send.resize(p.floats);
    ctx.group(Axis::kContext).recv(ctx.ws.cp_send.data(), sizeof(float) * (p.floats), last);
    const float* in = ctx.ws.cp_send.data();
    walk(p, [&](float* row, int width) {
      std::memcpy(row, in, sizeof(float) * (size_t)width);
      in += width;
    });
  }
  cp_gather_rows(ctx, dqkv, ld, 0, Dh, 0, ctx.batch);
}

}  // namespace ls
