#include "model/tensor_parallel.h"

#include "ops/ops.h"

namespace ls {

void chained_fold(StepContext& ctx, int passes, const ChainOutput& out,
                  const std::function<void(int, int, bool)>& fold) {
  const int tp = ctx.tp, me = ctx.tp_rank;
  if (tp == 1) {
    fold(0, passes, false);
    return;
  }
  // Kernels run asynchronously on a kernel backend: none may still touch the outputs the host is about to write.
  ops::synchronize();
  // A contiguous output travels itself; scattered outputs through the packed buffer.
  float* buffer = out.data;
  if (!buffer) {
    ctx.ws.tp_partial.resize(out.floats);
    buffer = ctx.ws.tp_partial.data();
  }
  const int segments = passes * tp;
  const int next = (me + 1) % tp, previous = (me + tp - 1) % tp;
  for (int p = 0; p < passes; ++p) {
    const int segment = p * tp + me;
    if (segment > 0) {
      ops::synchronize();
      ctx.mesh->tp_recv(buffer, out.floats, previous);
      if (out.unpack) out.unpack(buffer);
    }
    fold(p, 1, segment > 0);
    if (segment + 1 < segments) {
      ops::synchronize();
      if (out.pack) out.pack(buffer);
      ctx.mesh->tp_send(buffer, out.floats, next);
    }
  }
  // The last segment's owner, TP rank tp - 1, has the finished outputs.
  if (out.scatter) {  // each rank its own rows
    const int64_t each = out.floats / tp;
    if (me == tp - 1) {
      ops::synchronize();
      for (int t = 0; t < tp - 1; ++t) ctx.mesh->tp_send(buffer + t * each, each, t);
    } else {
      ctx.mesh->tp_recv(buffer + me * each, each, tp - 1);
    }
    return;
  }
  if (me == tp - 1) {
    ops::synchronize();
    if (out.pack) out.pack(buffer);
  }
  ctx.mesh->tp_broadcast(buffer, out.floats, tp - 1);
  if (me != tp - 1 && out.unpack) out.unpack(buffer);
}

void gather_stream(StepContext& ctx, const float* local, float* full, int64_t width) {
  const int64_t n = ctx.stream_tokens * width;
  ops::synchronize();  // the host reads what kernels wrote
  if (!ctx.sp) {
    ops::copy_to_host(full, local, sizeof(float) * n);
    return;
  }
  ctx.mesh->tp_all_gather(local, full, sizeof(float) * n);
}

const float* every_token(StepContext& ctx, const float* held, ops::DeviceVector<float>& gathered) {
  if (!ctx.sp) return held;
  gathered.resize(ctx.tokens * ctx.cfg.d_model);
  gather_stream(ctx, held, gathered.data(), ctx.cfg.d_model);
  return gathered.data();
}

ChainOutput stream_output(StepContext& ctx, float* data) {
  ChainOutput out;
  out.data = data;
  out.floats = ctx.tokens * ctx.cfg.d_model;
  out.scatter = ctx.sp;
  return out;
}

}  // namespace ls
