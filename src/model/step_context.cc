// StepContext and StepWorkspace: a step's view for the blocks (its trace
// pieces) and what a model keeps allocated between steps.
#include "model/step_context.h"

#include <cstring>
#include <stdexcept>

#include "model/context_parallel.h"
#include "ops/ops.h"

namespace ls {

const ParamInfo& StepContext::param(const std::string& name) const {
  for (const ParamInfo& p : params)
    if (p.name == name) return p;
  throw std::out_of_range("engine: no parameter '" + name + "'");
}

void StepContext::trace_tensor(const char* phase, int layer, const char* op, const char* name, const float* data,
                               std::vector<int64_t> shape, TraceLayout layout, TraceDtype dtype) const {
  if (!trace) return;
  ops::synchronize();  // the host reads what kernels wrote
  // This rank's first token in the step's (sample, position) order: its
  // data-parallel share, then its microbatch.
  const int mb = std::max(1, microbatches);
  const int64_t S = cfg.seq_len;
  const int64_t first_row = ((int64_t)mesh->rank(Axis::kData) * batch * mb + (int64_t)microbatch * batch) * S;
  shape[0] = tokens * dp() * mb;
  TracePiece piece;
  switch (layout.rows) {
    case TraceRows::kTokens: piece.rows.push_back({first_row, 0, tokens}); break;
    case TraceRows::kStream:  // context parallel: this rank's positions of them (stream_rows)
      if (cp() == 1) {
        piece.rows.push_back({first_row + stream_first, 0, stream_tokens});
        break;
      }
      cp_for_each_held(*this, (int)(stream_first / S), (int)(stream_tokens / S),
                       [&](int64_t row, int count) { piece.rows.push_back({first_row + row, row - stream_first, count}); });
      break;
    case TraceRows::kHeld:
      if (cp() == 1) {
        piece.rows.push_back({first_row, 0, tokens});
        break;
      }
      cp_for_each_held(*this, 0, batch, [&](int64_t row, int count) { piece.rows.push_back({first_row + row, row, count}); });
      break;
  }
  int64_t cols = 1;
  for (size_t d = 1; d < shape.size(); ++d) cols *= shape[d];
  if (layout.split_parts > 0 && tp() > 1) {
    const int D = cfg.d_model, w = width_held();
    for (int k = 0; k < layout.split_parts; ++k) piece.cols.push_back({(int64_t)k * D + (int64_t)tp_rank() * w, (int64_t)k * w, w});
    piece.ld = (int64_t)layout.split_parts * w;
  } else {
    piece.cols.push_back({0, 0, cols});
    piece.ld = cols;
  }
  trace->piece(phase, layer, op, name, data, shape, piece, dtype);
}

const float* StepContext::token_slot_order(const LayerActs& acts, const float* rows, int width) const {
  ops::synchronize();
  const int64_t NK = tokens * cfg.top_k;
  ws.trace_rows.resize((size_t)NK * width);
  for (int64_t i = 0; i < NK; ++i)
    std::memcpy(&ws.trace_rows[i * width], &rows[acts.row_of[i] * width], sizeof(float) * width);
  return ws.trace_rows.data();
}

namespace {
template <class T>
int64_t allocated(const ops::DeviceVector<T>& v) { return (int64_t)(v.capacity() * sizeof(T)); }
}  // namespace

void StepWorkspace::hand_backward_scratch(StepWorkspace& to) {
  for (auto [mine, theirs] : {std::pair{&dh, &to.dh}, {&dtmp, &to.dtmp}, {&dlogits, &to.dlogits}, {&dye, &to.dye},
                              {&dxe, &to.dxe}, {&dg, &to.dg}, {&dz, &to.dz}, {&dmoe_in, &to.dmoe_in},
                              {&dattn_out, &to.dattn_out}, {&dqkv, &to.dqkv}, {&shared_dact, &to.shared_dact},
                              {&shared_du, &to.shared_du}, {&shared_dv, &to.shared_dv}, {&shared_dx, &to.shared_dx}})
    mine->swap(*theirs);
}

int64_t StepWorkspace::allocated_bytes() const {
  int64_t n = 0;
  for (const LayerActs& a : layers) {
    for (const auto* v : {&a.x, &a.attn_in, &a.attn_inv_rms, &a.qkv, &a.attn_probs, &a.attn_out, &a.mid, &a.moe_in,
                          &a.moe_inv_rms, &a.router_logits, &a.gates, &a.router_lse, &a.ye, &a.shared_u, &a.shared_v,
                          &a.shared_gate, &a.shared_act, &a.shared_out, &a.rows.x, &a.rows.u, &a.rows.v, &a.rows.sg})
      n += allocated(*v);
    n += allocated(a.sel) + allocated(a.row_of) + allocated(a.attn_probs_bf16);
  }
  for (const auto* v : {&h, &final_out, &final_inv_rms, &logits, &prob, &lse, &loss, &dh, &dtmp, &dlogits, &dye, &dxe,
                        &dg, &dz, &dmoe_in, &dattn_out, &dqkv, &shared_dact, &shared_du, &shared_dv, &shared_dx,
                        &router_sums, &slots.x, &slots.act, &slots.y, &slots.dy, &slots.dact, &slots.du, &slots.dv,
                        &slots.dx, &send, &recv, &row_vector, &tp_partial, &sp_gathered, &sp_dh, &cp_send, &cp_recv,
                        &cp_link, &cp_ds, &cp_pack, &sp_rows, &sp_rows_all})
    n += allocated(*v);
  n += allocated(sel_held);
  for (const auto& v : grad_state) n += allocated(v);
  return n;
}

}  // namespace ls
