#include "model/tensor_parallel.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cluster/shared_chain.h"
#include "common/numerics_level.h"
#include "common/op_profile.h"
#include "ops/ops.h"

namespace ls {
namespace {

// Part b of packed outputs into the buffer, or back (contiguous outputs: nothing to do).
void pack_part(const ChainOutput& out, int b, float* at) {
  const OpTimer copying(OpKind::kCopy);
  if (out.pack) out.pack(b, at);
}
void unpack_part(const ChainOutput& out, int b, const float* at) {
  const OpTimer copying(OpKind::kCopy);
  if (out.unpack) out.unpack(b, at);
}
// Every part.
void pack_parts(const ChainOutput& out, float* buffer) {
  if (out.pack)
    for (int b = 0; b < out.parts; ++b) pack_part(out, b, buffer + out.part_begin(b));
}
void unpack_parts(const ChainOutput& out, const float* buffer) {
  if (out.unpack)
    for (int b = 0; b < out.parts; ++b) unpack_part(out, b, buffer + out.part_begin(b));
}

// The group a chain runs over.
Axis chain_axis(const StepContext& ctx, const ChainOutput& out) {
  return out.expert_hidden ? ctx.expert_tensor_axis() : Axis::kTensor;
}

// numerics.level=local, the usual way (Megatron's row-parallel GEMM): every
// rank folds its own k-range from +0 with the level's GEMM, and the partial
// outputs are summed by the communicator's all-reduce (with sequence
// parallel, a reduce-scatter to each rank's stream rows) in whatever order
// it adds them. The bits then depend on mesh.tp: the baseline the chain's
// price is measured against.
void summed_fold(StepContext& ctx, int passes, const ChainOutput& out, const ChainStep& fold, RowBlock all) {
  Communicator& group = ctx.group(chain_axis(ctx, out));
  const int tp = group.size(), me = group.rank();
  fold(0, passes, false, all);
  ops::synchronize();
  float* buffer = out.data;
  if (!buffer) {
    ctx.ws.tp_partial.resize(out.floats);
    buffer = ctx.ws.tp_partial.data();
    pack_parts(out, buffer);
  }
  if (out.scatter) {  // each rank its own rows, in place (a contiguous output: tp_partial is free)
    const int64_t each = out.floats / tp;
    ctx.ws.tp_partial.resize(each);
    float* mine = ctx.ws.tp_partial.data();
    group.reduce_scatter_sum(buffer, mine, std::vector<size_t>((size_t)tp, (size_t)each));
    ops::synchronize();
    std::copy(mine, mine + each, buffer + me * each);
    return;
  }
  group.all_reduce_sum(buffer, (size_t)out.floats);
  unpack_parts(out, buffer);
}

// Bytes into or out of a shared slot, timed as copies (--profile-ops).
void copy_bytes(void* to, const void* from, size_t n) {
  const OpTimer copying(OpKind::kCopy);
  std::memcpy(to, from, n);
}

// A chain's hand-offs between neighbours: messages, or (mesh.shared_memory,
// cluster/shared_chain.h) copies through the group's shared slot, each block
// flagged as its segment finishes. The shared path also puts the finished
// blocks out one by one, so the others read each as soon as it is done.
// Its bytes count as `shared_send` (partials) and `shared_final` (each
// finished output, written once), not as messages.
class ChainLinks {
 public:
  ChainLinks(StepContext& ctx, Axis axis, int blocks, int64_t floats) : group_(ctx.group(axis)) {
    const int tp = group_.size(), me = group_.rank();
    next_ = (me + 1) % tp;
    previous_ = (me + tp - 1) % tp;
    SharedChain* chain = ctx.mesh->shared_chain();  // the tensor group's: no other group's chain goes through it
    if (!chain || axis != Axis::kTensor) return;
    const SharedChain::Turn turn = chain->next_turn();  // on every rank, whichever way this chain goes
    if (floats > chain->capacity || blocks > SharedChain::kMaxBlocks) return;
    chain_ = chain;
    slot_ = chain->slot(turn.slot);
    flags_ = turn.slot;
    stamp_ = turn.stamp;
  }
  bool shared() const { return chain_ != nullptr; }
  // Segment `segment` of block b, the chain buffer's floats [at, at + n) in
  // `part`, is done: on to the next rank.
  void hand_on(int b, int segment, const float* part, int64_t at, int64_t n) {
    if (!chain_) return group_.send(part, sizeof(float) * (size_t)n, next_);
    copy(slot_ + at, part, n);
    publish_flag(chain_->flag(flags_, b), stamp_ + segment + 1);
    group_.stats.count("shared_send", sizeof(float) * (size_t)n);
  }
  // The previous segment of block b, into `part`.
  void receive(int b, int segment, float* part, int64_t at, int64_t n) {
    if (!chain_) return group_.recv(part, sizeof(float) * (size_t)n, previous_);
    wait(b, stamp_ + segment, "recv");
    copy(part, slot_ + at, n);
  }
  // The last segment of block b: finished, for every other rank.
  void finish(int b, const float* part, int64_t at, int64_t n) {
    copy(slot_ + at, part, n);
    publish_flag(chain_->flag(flags_, b), stamp_ + kFinished);
    group_.stats.count("shared_final", sizeof(float) * (size_t)n);
  }
  // The finished outputs' floats [at, at + n), once blocks [first, last) are done.
  void read_finished(int first, int last, float* to, int64_t at, int64_t n) {
    for (int b = first; b < last; ++b) wait(b, stamp_ + kFinished, "broadcast");
    copy(to, slot_ + at, n);
  }

 private:
  static constexpr int64_t kFinished = SharedChain::kStampStride - 1;
  static void copy(float* to, const float* from, int64_t n) { copy_bytes(to, from, sizeof(float) * (size_t)n); }
  // Exposed time, as the message it replaces (a receive, or the broadcast of the finished outputs).
  void wait(int b, int64_t value, const char* kind) { chain_->wait_flag(group_.stats, kind, flags_, b, value); }

  Communicator& group_;
  int next_ = 0, previous_ = 0;
  SharedChain* chain_ = nullptr;
  float* slot_ = nullptr;
  int flags_ = 0;
  int64_t stamp_ = 0;
};

}  // namespace

int chain_blocks(int64_t rows) { return (int)std::max<int64_t>(1, std::min<int64_t>(8, rows / 64)); }

void chained_fold(StepContext& ctx, int passes, const ChainOutput& out, const ChainStep& fold) {
  Communicator& group = ctx.group(chain_axis(ctx, out));
  const int tp = group.size(), me = group.rank();
  const RowBlock all{0, out.rows, -1};  // every row and part
  if (tp == 1) {
    fold(0, passes, false, all);
    return;
  }
  if (local_numerics()) return summed_fold(ctx, passes, out, fold, all);
  // Kernels run asynchronously on a kernel backend: none may still touch the outputs the host is about to write.
  ops::synchronize();
  // A contiguous output travels itself, block by block; scattered outputs through the packed buffer, part by part.
  float* buffer = out.data;
  if (!buffer) {
    ctx.ws.tp_partial.resize(out.floats);
    buffer = ctx.ws.tp_partial.data();
  }
  const bool by_rows = out.rows > 0;
  const int blocks = by_rows ? chain_blocks(out.rows) : out.parts;
  const int64_t width = by_rows ? out.floats / out.rows : 0;
  std::vector<RowBlock> cut((size_t)blocks);
  std::vector<int64_t> begin((size_t)blocks + 1);  // floats of the buffer
  for (int b = 0; b < blocks; ++b) {
    cut[(size_t)b] = RowBlock{0, 0, b};
    begin[(size_t)b] = out.part_begin(b);
    if (by_rows) {
      cut[(size_t)b] = RowBlock{out.rows * b / blocks, out.rows * (b + 1) / blocks - out.rows * b / blocks, b};
      begin[(size_t)b] = cut[(size_t)b].first * width;
    }
  }
  begin[(size_t)blocks] = by_rows ? out.rows * width : out.part_begin(blocks);
  ChainLinks links(ctx, chain_axis(ctx, out), blocks, out.floats);
  const int segments = passes * tp;
  // Segment p * tp + me of each block: the blocks of one pass go down the
  // chain one after another, so while this rank folds block b the next
  // continues block b - 1 (hand-offs do not wait for the receiver; between
  // two ranks they arrive in the order sent).
  for (int p = 0; p < passes; ++p) {
    const int segment = p * tp + me;
    for (int b = 0; b < blocks; ++b) {
      float* part = buffer + begin[(size_t)b];
      const int64_t floats = begin[(size_t)b + 1] - begin[(size_t)b];
      if (segment > 0) {
        ops::synchronize();
        links.receive(b, segment, part, begin[(size_t)b], floats);
        unpack_part(out, b, part);
      }
      fold(p, 1, segment > 0, cut[(size_t)b]);
      if (segment + 1 < segments) {
        ops::synchronize();
        pack_part(out, b, part);
        links.hand_on(b, segment, part, begin[(size_t)b], floats);
      } else if (links.shared()) {  // the finished block, out at once
        ops::synchronize();
        pack_part(out, b, part);
        links.finish(b, part, begin[(size_t)b], floats);
      }
    }
  }
  if (links.shared()) {
    if (me == tp - 1) return;
    if (out.scatter) {  // this rank's own rows
      const int64_t each = out.floats / tp;
      links.read_finished(0, blocks, buffer + me * each, me * each, each);
      return;
    }
    for (int b = 0; b < blocks; ++b) {
      const int64_t floats = begin[(size_t)b + 1] - begin[(size_t)b];
      links.read_finished(b, b + 1, buffer + begin[(size_t)b], begin[(size_t)b], floats);
      unpack_part(out, b, buffer + begin[(size_t)b]);
    }
    return;
  }
  // The last segment's owner, TP rank tp - 1, has the finished outputs.
  if (out.scatter) {  // each rank its own rows
    const int64_t each = out.floats / tp;
    if (me == tp - 1) {
      ops::synchronize();
      for (int t = 0; t < tp - 1; ++t) group.send(buffer + t * each, sizeof(float) * each, t);
    } else {
      group.recv(buffer + me * each, sizeof(float) * each, tp - 1);
    }
    return;
  }
  if (me == tp - 1) {
    ops::synchronize();
    pack_parts(out, buffer);
  }
  group.broadcast(buffer, sizeof(float) * out.floats, tp - 1);
  if (me != tp - 1) unpack_parts(out, buffer);
}

namespace {

// Sequence parallel's all-gather of stream rows (`row_bytes` each, every
// rank's stream_tokens of them), each rank's part handed to `at_hand` (if
// any) as soon as this rank has it: its own first, then the others'.
// Through the tensor group's shared slot (mesh.shared_memory): each rank
// copies its rows in and flags them, and the others take each part as its
// flag turns (counted as `shared_gather`); else a started all-gather, this
// rank's own part computed on while it is in flight.
// `rows` rows a rank (sequence parallel's: its stream tokens).
void gather_stream_parts(StepContext& ctx, const void* local, void* full, size_t row_bytes, const RowsAtHand* at_hand,
                         int64_t rows) {
  Communicator& group = ctx.group(Axis::kTensor);
  const int tp = group.size(), me = group.rank();
  const size_t n = (size_t)rows * row_bytes;
  const auto part = [&](void* base, int t) { return (char*)base + (size_t)t * n; };
  const auto hand = [&](const void* at, int t) {
    if (at_hand) (*at_hand)((const float*)at, t * rows, rows);
  };
  ops::synchronize();  // the host reads what kernels wrote
  SharedChain* chain = ctx.mesh->shared_chain();
  // On every rank, whichever way this gather goes; rank t's part is flagged on flag t.
  const SharedChain::Turn turn = chain ? chain->next_turn() : SharedChain::Turn{};
  if (chain && n * tp <= (size_t)chain->capacity * sizeof(float)) {
    const int64_t stamp = turn.stamp + 1;
    char* slot = (char*)chain->slot(turn.slot);
    copy_bytes(part(slot, me), local, n);
    publish_flag(chain->flag(turn.slot, me), stamp);
    group.stats.count("shared_gather", n);
    copy_bytes(part(full, me), local, n);
    hand(local, me);
    for (int k = 1; k < tp; ++k) {
      const int t = (me + k) % tp;
      chain->wait_flag(group.stats, "all_gather", turn.slot, t, stamp);
      copy_bytes(part(full, t), part(slot, t), n);
      hand(part(full, t), t);
    }
    return;
  }
  const std::vector<size_t> bytes((size_t)tp, n);
  if (!at_hand) return group.all_gather(local, full, bytes);
  Pending gathering = group.start_all_gather(local, full, bytes);
  hand(local, me);
  gathering->wait();
  for (int t = 0; t < tp; ++t)
    if (t != me) hand(part(full, t), t);
}

}  // namespace

void gather_stream_rows(StepContext& ctx, const float* local, float* full, int64_t width) {
  if (!ctx.sp) {
    ops::synchronize();  // the host reads what kernels wrote
    ops::copy_to_host(full, local, sizeof(float) * ctx.stream_tokens * width);
    return;
  }
  gather_stream_parts(ctx, local, full, sizeof(float) * (size_t)width, nullptr, ctx.stream_tokens);
}

namespace {

// Rows [t x rows, (t + 1) x rows) of full[tp x rows, width] are TP rank t's;
// afterwards every rank holds them all (an all-gather in place, through the
// shared slot where there is one).
void gather_tp_rows(StepContext& ctx, float* full, int64_t rows, int64_t width) {
  if (ctx.tp() == 1) return;
  // The message path's all-gather reads its input apart from its output: this rank's rows, copied out first.
  ops::DeviceVector<float>& mine = ctx.ws.sp_rows;
  mine.resize(rows * width);
  ops::synchronize();
  copy_bytes(mine.data(), full + ctx.tp_rank() * rows * width, sizeof(float) * (size_t)(rows * width));
  gather_stream_parts(ctx, mine.data(), full, sizeof(float) * (size_t)width, nullptr, rows);
}

bool splits_head(const StepContext& ctx) {
  const int tp = ctx.tp();
  if (tp == 1 || ctx.sp || ctx.cp() > 1 || ctx.microbatches > 0 || ctx.leaves % tp != 0) return false;
  const int64_t each = ctx.leaves / tp;
  return (each & (each - 1)) == 0;
}

}  // namespace

StepContext head_rows(const StepContext& ctx) {
  StepContext view = ctx;
  if (!splits_head(ctx)) return view;
  view.stream_tokens = ctx.tokens / ctx.tp();
  view.stream_first = view.stream_tokens * ctx.tp_rank();
  view.stream_leaves = ctx.leaves / ctx.tp();
  return view;
}

void join_head_sums(StepContext& ctx, const StepContext& head, float* sums, size_t n) {
  if (head.stream_tokens == ctx.stream_tokens) return;
  ops::synchronize();  // the sums, read by the group
  ctx.group(Axis::kTensor).all_reduce_sum(sums, n);
}

void join_head_rows(StepContext& ctx, const StepContext& head, float* dh, int64_t width) {
  if (head.stream_tokens == ctx.stream_tokens) return;
  gather_tp_rows(ctx, dh, head.stream_tokens, width);
}

const float* every_token(StepContext& ctx, const float* held, ops::DeviceVector<float>& gathered) {
  if (!ctx.sp) return held;
  gathered.resize(ctx.tokens * ctx.cfg.d_model);
  gather_stream_rows(ctx, held, gathered.data(), ctx.cfg.d_model);
  return gathered.data();
}

const float* every_token_rows(StepContext& ctx, const float* held, ops::DeviceVector<float>& gathered,
                              const RowsAtHand& at_hand) {
  if (!ctx.sp) {
    at_hand(held, 0, ctx.tokens);
    return held;
  }
  gathered.resize(ctx.tokens * ctx.cfg.d_model);
  gather_stream_parts(ctx, held, gathered.data(), sizeof(float) * (size_t)ctx.cfg.d_model, &at_hand,
                      ctx.stream_tokens);
  return gathered.data();
}

namespace {

// The expert rows of this data-parallel rank's tokens (acts.row_of's) made every token group rank's, put at
// their rows of the experts' batch (mesh.etp wider than mesh.tp; nothing otherwise).
void gather_token_group_rows(StepContext& ctx, const LayerActs& acts, float* rows) {
  Communicator& group = ctx.group(Axis::kExpertTokens);
  if (group.size() == 1) return;
  StepWorkspace& ws = ctx.ws;
  const int D = ctx.cfg.d_model;
  const int64_t NK = ctx.tokens * ctx.cfg.top_k, all = NK * group.size();
  ws.sp_rows.resize(NK * D);
  ws.sp_rows_all.resize(all * D);
  {
    const OpTimer copying(OpKind::kCopy);
    ops::copy_rows(rows, acts.row_of.data(), ws.sp_rows.data(), nullptr, NK, D);
    ops::synchronize();
  }
  all_gather_equal(group, ws.sp_rows.data(), ws.sp_rows_all.data(), sizeof(float) * (size_t)(NK * D));
  const OpTimer copying(OpKind::kCopy);
  ops::copy_rows(ws.sp_rows_all.data(), nullptr, rows, acts.batch_row_of_all.data(), all, D);
}

}  // namespace

void gather_expert_output_grads(StepContext& ctx, const LayerActs& acts) {
  if (!ctx.sp) return gather_token_group_rows(ctx, acts, ctx.ws.dye.data());
  StepWorkspace& ws = ctx.ws;
  const int D = ctx.cfg.d_model, K = ctx.cfg.top_k;
  const int64_t held = ctx.stream_tokens * K, all = ctx.tokens * K;
  ws.sp_rows.resize(held * D);
  ws.sp_rows_all.resize(all * D);
  {
    const OpTimer copying(OpKind::kCopy);
    ops::copy_rows(ws.dye.data(), acts.row_of.data() + ctx.stream_first * K, ws.sp_rows.data(), nullptr, held, D);
    ops::synchronize();
  }
  gather_stream_parts(ctx, ws.sp_rows.data(), ws.sp_rows_all.data(), sizeof(float) * (size_t)(K * D), nullptr,
                      ctx.stream_tokens);
  {
    const OpTimer copying(OpKind::kCopy);
    ops::copy_rows(ws.sp_rows_all.data(), nullptr, ws.dye.data(), acts.row_of.data(), all, D);
  }
  gather_token_group_rows(ctx, acts, ws.dye.data());
}

void gather_stream_rows(StepContext& ctx, const ops::DeviceVector<float>& held, ops::DeviceVector<float>& whole,
                        int64_t width) {
  if (ctx.sp) gather_stream_rows(ctx, held.data(), whole.data(), width);
}

void gather_stream_rows(StepContext& ctx, const ops::DeviceVector<int>& held, ops::DeviceVector<int>& whole,
                        int64_t width) {
  if (ctx.sp)
    gather_stream_parts(ctx, held.data(), whole.data(), sizeof(int) * (size_t)width, nullptr, ctx.stream_tokens);
}

ChainOutput stream_output(StepContext& ctx, float* data) {
  ChainOutput out;
  out.data = data;
  out.floats = ctx.tokens * ctx.cfg.d_model;
  out.rows = ctx.tokens;
  out.scatter = ctx.sp;
  return out;
}

}  // namespace ls
