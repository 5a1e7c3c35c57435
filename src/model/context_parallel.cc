#include "model/context_parallel.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "ops/attention.h"
#include "ops/ops.h"

namespace ls {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Adds its lifetime to `sum`: the compute a rank does, not its waits.
struct BusyTimer {
  double& sum;
  double t0 = now_seconds();
  ~BusyTimer() { sum += now_seconds() - t0; }
};

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

// Every CP rank's rows of its ranges (columns [col, col + width) of an
// [N, ld] matrix, every sample) made whole on every rank: an all-gather.
// The host packs and unpacks: the kernels writing m must be done.
void gather_held_rows(StepContext& ctx, float* m, int64_t ld, int col, int width) {
  ops::synchronize();
  const int S = ctx.cfg.seq_len, cp = ctx.cp;
  const bool zz = ctx.mesh->cp_zigzag();
  const int64_t each = (int64_t)ctx.batch * (S / cp) * width;  // every rank holds S / cp positions of a sample
  ctx.ws.cp_send.resize((size_t)each);
  ctx.ws.cp_recv.resize((size_t)(each * cp));
  float* out = ctx.ws.cp_send.data();
  const std::vector<QueryRange> mine = cp_query_ranges(S, cp, ctx.cp_rank, zz);
  for (int b = 0; b < ctx.batch; ++b)
    for (const QueryRange& r : mine) pack_rows(m, ld, (int64_t)b * S + r.first, r.count, col, width, out);
  ctx.mesh->cp_all_gather(ctx.ws.cp_send.data(), ctx.ws.cp_recv.data(), (size_t)each);
  ctx.stats.cp_bytes_sent += each * (int64_t)sizeof(float) * (cp - 1);
  for (int q = 0; q < cp; ++q) {
    const float* in = ctx.ws.cp_recv.data() + q * each;
    const std::vector<QueryRange> held = cp_query_ranges(S, cp, q, zz);
    for (int b = 0; b < ctx.batch; ++b)
      for (const QueryRange& r : held) unpack_rows(m, ld, (int64_t)b * S + r.first, r.count, col, width, in);
  }
}

// Where range i of `ranges` keeps its P in a (sample, head)'s share: after
// the earlier ranges'. probs_offset(ranges, ranges.size()) is the share's size.
int64_t probs_offset(const std::vector<QueryRange>& ranges, size_t i) {
  int64_t n = 0;
  for (size_t k = 0; k < i; ++k) n += ops::attention_range_probs_floats(ranges[k].count, ranges[k].first);
  return n;
}

}  // namespace

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

int64_t cp_probs_floats(int S, int cp, int rank, bool zigzag) {
  const std::vector<QueryRange> ranges = cp_query_ranges(S, cp, rank, zigzag);
  return probs_offset(ranges, ranges.size());
}

void cp_attention_forward(StepContext& ctx, const float* qkv, int heads, int hd, float scale, float* P,
                          float* attn_out) {
  const int S = ctx.cfg.seq_len, Dh = heads * hd;
  const int64_t ld = 3 * (int64_t)Dh;
  const bool zz = ctx.mesh->cp_zigzag();
  const std::vector<QueryRange> ranges = cp_query_ranges(S, ctx.cp, ctx.cp_rank, zz);
  const int64_t per_head = probs_offset(ranges, ranges.size());
  {
    BusyTimer busy{ctx.stats.cp_attention_seconds};
    for (size_t i = 0; i < ranges.size(); ++i)
      ops::attention_forward_range_heads(qkv, ctx.batch, heads, S, hd, scale, ranges[i].first, ranges[i].count, P,
                                         per_head, probs_offset(ranges, i), attn_out);
    ops::synchronize();  // a kernel backend: the busy time is the kernels'
  }
  gather_held_rows(ctx, attn_out, Dh, 0, Dh);
}

void cp_attention_backward(StepContext& ctx, const float* qkv, int heads, int hd, float scale, const float* P,
                           const float* dattn_out, float* dqkv) {
  const int S = ctx.cfg.seq_len, Dh = heads * hd;
  const int64_t ld = 3 * (int64_t)Dh;
  const bool zz = ctx.mesh->cp_zigzag();
  const std::vector<QueryRange> ranges = cp_query_ranges(S, ctx.cp, ctx.cp_rank, zz);
  const std::vector<ChainLink> chain = cp_chain(S, ctx.cp, zz);
  const int64_t per_head = probs_offset(ranges, ranges.size());
  // A key's row takes its first term in the range that holds it: +0 until then.
  ops::fill(dqkv, ctx.tokens * ld, 0.0f);
  ops::DeviceVector<float>& link = ctx.ws.cp_link;
  // My links in ascending position; for each, every sample in turn, so the
  // next rank starts on sample 0 while this one works on sample 1.
  for (size_t k = 0; k < chain.size(); ++k) {
    if (chain[k].rank != ctx.cp_rank) continue;
    const QueryRange r = chain[k].range;
    size_t mine = 0;  // which of my ranges
    while (ranges[mine].first != r.first) ++mine;
    const int64_t p_off = probs_offset(ranges, mine);
    for (int b = 0; b < ctx.batch; ++b) {
      const int64_t row0 = (int64_t)b * S;
      if (k > 0 && chain[k - 1].rank != ctx.cp_rank) {  // the partial dK, dV of keys [0, r.first)
        ops::synchronize();  // the host rewrites rows kernels may still touch
        link.resize((size_t)r.first * 2 * Dh);
        ctx.mesh->cp_recv(link.data(), link.size(), chain[k - 1].rank);
        const float* in = link.data();
        unpack_rows(dqkv, ld, row0, r.first, Dh, 2 * Dh, in);
      }
      {
        BusyTimer busy{ctx.stats.cp_attention_seconds};
        ops::attention_backward_range_heads(qkv, b, heads, S, hd, scale, r.first, r.count, P, per_head, p_off,
                                            dattn_out, dqkv, /*continue_kv=*/k > 0);
        ops::synchronize();
      }
      if (k + 1 < chain.size() && chain[k + 1].rank != ctx.cp_rank) {  // keys [0, end) go on
        const int end = r.first + r.count;
        link.resize((size_t)end * 2 * Dh);
        float* out = link.data();
        pack_rows(dqkv, ld, row0, end, Dh, 2 * Dh, out);
        ctx.mesh->cp_send(link.data(), link.size(), chain[k + 1].rank);
        ctx.stats.cp_bytes_sent += (int64_t)link.size() * (int64_t)sizeof(float);
      }
    }
  }
  // The finished dK, dV from the last link's rank; every rank's dq rows.
  ops::synchronize();
  const int last = chain.back().rank;
  ctx.ws.cp_send.resize((size_t)(ctx.tokens * 2 * Dh));
  float* out = ctx.ws.cp_send.data();
  if (ctx.cp_rank == last) pack_rows(dqkv, ld, 0, (int)ctx.tokens, Dh, 2 * Dh, out);
  ctx.mesh->cp_broadcast(ctx.ws.cp_send.data(), ctx.ws.cp_send.size(), last);
  if (ctx.cp_rank == last) {
    ctx.stats.cp_bytes_sent += (int64_t)ctx.ws.cp_send.size() * (int64_t)sizeof(float) * (ctx.cp - 1);
  } else {
    const float* in = ctx.ws.cp_send.data();
    unpack_rows(dqkv, ld, 0, (int)ctx.tokens, Dh, 2 * Dh, in);
  }
  gather_held_rows(ctx, dqkv, ld, 0, Dh);
}

}  // namespace ls
