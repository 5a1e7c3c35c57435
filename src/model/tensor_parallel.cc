#include "model/tensor_parallel.h"

#include <algorithm>
#include <vector>

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

// numerics.level=local, the usual way (Megatron's row-parallel GEMM): every
// rank folds its own k-range from +0 with the level's GEMM, and the partial
// outputs are summed by the communicator's all-reduce (with sequence
// parallel, a reduce-scatter to each rank's stream rows) in whatever order
// it adds them. The bits then depend on mesh.tp: the baseline the chain's
// price is measured against.
void summed_fold(StepContext& ctx, int passes, const ChainOutput& out, const ChainStep& fold, RowBlock all) {
  Communicator& group = ctx.group(Axis::kTensor);
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

}  // namespace

int chain_blocks(int64_t rows) { return (int)std::max<int64_t>(1, std::min<int64_t>(8, rows / 64)); }

void chained_fold(StepContext& ctx, int passes, const ChainOutput& out, const ChainStep& fold) {
  const int tp = ctx.tp(), me = ctx.tp_rank();
  const RowBlock all{0, out.rows, -1};  // every row and part
  if (tp == 1) {
    fold(0, passes, false, all);
    return;
  }
  if (local_numerics()) return summed_fold(ctx, passes, out, fold, all);
  Communicator& group = ctx.group(Axis::kTensor);
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
  const int segments = passes * tp;
  const int next = (me + 1) % tp, previous = (me + tp - 1) % tp;
  // Segment p * tp + me of each block: the blocks of one pass go down the
  // chain one after another, so while this rank folds block b the next
  // continues block b - 1 (sends are buffered; messages between two ranks
  // arrive in the order sent).
  for (int p = 0; p < passes; ++p) {
    const int segment = p * tp + me;
    for (int b = 0; b < blocks; ++b) {
      RowBlock block{0, 0, b};
      int64_t begin = out.part_begin(b), end = out.part_begin(b + 1);  // floats of the buffer
      if (by_rows) {
        block = RowBlock{out.rows * b / blocks, out.rows * (b + 1) / blocks - out.rows * b / blocks, b};
        begin = block.first * width, end = (block.first + block.count) * width;
      }
      float* part = buffer + begin;
      const size_t bytes = sizeof(float) * (size_t)(end - begin);
      if (segment > 0) {
        ops::synchronize();
        group.recv(part, bytes, previous);
        unpack_part(out, b, part);
      }
      fold(p, 1, segment > 0, block);
      if (segment + 1 < segments) {
        ops::synchronize();
        pack_part(out, b, part);
        group.send(part, bytes, next);
      }
    }
  }
  // The last segment's owner, TP rank tp - 1, has the finished outputs.
  if (out.scatter) {  // each rank its own rows
    const int64_t each = out.floats / tp;
    if (me == tp - 1) {
      ops::synchronize();
      if (ctx.take_debug_fault(MeshFault::kTpChain)) flip_bit(buffer);  // rank 0's rows, on their way
      for (int t = 0; t < tp - 1; ++t) group.send(buffer + t * each, sizeof(float) * each, t);
    } else {
      group.recv(buffer + me * each, sizeof(float) * each, tp - 1);
    }
    return;
  }
  if (me == tp - 1) {
    ops::synchronize();
    pack_parts(out, buffer);
    if (out.data && ctx.take_debug_fault(MeshFault::kTpChain)) flip_bit(buffer);  // the chain's output, in place
  }
  group.broadcast(buffer, sizeof(float) * out.floats, tp - 1);
  if (me != tp - 1) unpack_parts(out, buffer);
}

void gather_stream(StepContext& ctx, const float* local, float* full, int64_t width) {
  const int64_t n = ctx.stream_tokens * width;
  ops::synchronize();  // the host reads what kernels wrote
  if (!ctx.sp) {
    ops::copy_to_host(full, local, sizeof(float) * n);
    return;
  }
  all_gather_equal(ctx.group(Axis::kTensor), local, full, sizeof(float) * n);
}

const float* every_token(StepContext& ctx, const float* held, ops::DeviceVector<float>& gathered) {
  if (!ctx.sp) return held;
  gathered.resize(ctx.tokens * ctx.cfg.d_model);
  gather_stream(ctx, held, gathered.data(), ctx.cfg.d_model);
  return gathered.data();
}

void gather_expert_output_grads(StepContext& ctx, const LayerActs& acts) {
  if (!ctx.sp) return;
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
  all_gather_equal(ctx.group(Axis::kTensor), ws.sp_rows.data(), ws.sp_rows_all.data(), sizeof(float) * held * D);
  const OpTimer copying(OpKind::kCopy);
  ops::copy_rows(ws.sp_rows_all.data(), nullptr, ws.dye.data(), acts.row_of.data(), all, D);
}

void gather_stream_rows(StepContext& ctx, const ops::DeviceVector<float>& held, ops::DeviceVector<float>& whole,
                        int64_t width) {
  if (ctx.sp) gather_stream(ctx, held.data(), whole.data(), width);
}

void gather_stream_rows(StepContext& ctx, const ops::DeviceVector<int>& held, ops::DeviceVector<int>& whole,
                        int64_t width) {
  if (!ctx.sp) return;
  ops::synchronize();  // the host reads what kernels wrote
  all_gather_equal(ctx.group(Axis::kTensor), held.data(), whole.data(), sizeof(int) * ctx.stream_tokens * width);
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
