// Expert parallelism: the exchange plan of one layer (docs/MOE.md). The EP
// group shares every rank's counts per expert and each row's leaf id, and
// each round's rows move from the sources' dispatch order into the owners'
// slots and back, packed in one order both sides walk alike. At ep 1 the
// same calls copy rows between the dispatch order and the slots directly.
#include "model/expert_parallel.h"

#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cluster/message_label.h"
#include "common/op_profile.h"
#include "common/precision.h"
#include "contract.h"
#include "model/context_parallel.h"
#include "ops/ops.h"

namespace ls {

namespace {

// Bytes a vector holds allocated.
template <class T, class A>
int64_t held(const std::vector<T, A>& v) {
  return (int64_t)(v.capacity() * sizeof(T));
}

// Buffers only grow, each to exactly what is asked (so what is counted is
// what the plans asked for), and are counted as allocated.
void grow(ops::DeviceVector<float>& v, size_t n) {
  if (v.size() >= n) return;
  if (v.capacity() < n) ops::DeviceVector<float>(n).swap(v);
  else v.resize(n);
}

// The source's part of each segment of an owner's round: the owner's
// expert e takes rows first_row[e] .. first_row[e] + rows[e] - 1 (in its row
// order) from this source. fn(segment, first row of the piece in the
// expert's order, rows) in segment order, which both sides of an exchange
// walk alike.
template <class Fn>
void for_each_piece(const RoundPlan& plan, int r, const int64_t* first_row, const int64_t* rows, Fn&& fn) {
  for (const Segment& s : plan.round[r]) {
    const int64_t lo = std::max(s.first, first_row[s.expert]);
    const int64_t hi = std::min(s.first + s.rows, first_row[s.expert] + rows[s.expert]);
    if (lo < hi) fn(s, lo, hi - lo);
  }
}

// Source `src`'s rows of owner `owner`'s experts: first_row[e] rows of
// earlier sources come first, then rows[e] of this source.
void source_part(const StepContext& ctx, const LayerActs& acts, int src, int owner, int64_t* first_row,
                 int64_t* rows) {
  const int E = ctx.cfg.experts, El = ctx.local_experts;
  for (int e = 0; e < El; ++e) {
    first_row[e] = 0;
    for (int earlier = 0; earlier < src; ++earlier) first_row[e] += acts.counts[(size_t)earlier * E + owner * El + e];
    rows[e] = acts.counts[(size_t)src * E + owner * El + e];
  }
}

// n floats rewritten as their bf16 (ls::to_bf16) in the first 2n bytes,
// and back: element i never overwrites one not yet read. (Bytes through
// memcpy: the buffer's type is float.)
void pack_bf16_in_place(float* p, int64_t n) {
  char* bytes = reinterpret_cast<char*>(p);
  for (int64_t i = 0; i < n; ++i) {
    float f;
    memcpy(&f, bytes + 4 * i, 4);
    const uint16_t b = ls::to_bf16(f);
    memcpy(bytes + 2 * i, &b, 2);
  }
}
void unpack_bf16_in_place(float* p, int64_t n) {
  char* bytes = reinterpret_cast<char*>(p);
  for (int64_t i = n - 1; i >= 0; --i) {
    uint16_t b;
    memcpy(&b, bytes + 2 * i, 2);
    const float f = ls::from_bf16(b);
    memcpy(bytes + 4 * i, &f, 4);
  }
}

}  // namespace

// The buffers a layer's rounds need, grown to its plans and counted.
void hold_moe_buffers(StepContext& ctx, LayerActs& acts) {
  StepWorkspace& ws = ctx.ws;
  const int D = ctx.cfg.d_model, F = ctx.expert_d_ff_held();
  const size_t slots = (size_t)ctx.own_plan(acts).slots;
  // Without expert parallelism y, dy and dx live in the dispatch rows: no slots for them.
  grow(ws.slots.x, slots * D);
  if (ctx.ep() > 1)
    for (ops::DeviceVector<float>* v : {&ws.slots.y, &ws.slots.dy, &ws.slots.dx}) grow(*v, slots * D);
  // The d_ff-wide ones: every slot, or with context parallel the slots of the rank's block of experts.
  RoundPlan cp_plan;
  const SlotRange in_slots = hidden_slot_range(computed_expert_plan(ctx, acts, cp_plan));
  const size_t hidden_slots = ctx.cp() > 1 ? (size_t)(in_slots.end - in_slots.first) : slots;
  for (ops::DeviceVector<float>* v : {&ws.slots.act, &ws.slots.dact, &ws.slots.du, &ws.slots.dv})
    grow(*v, hidden_slots * F);
  const size_t rows_held = (size_t)acts.rows.off[ctx.local_experts];
  // u, v and sg for the rows this rank computes: all held, or with context parallel its expert block's.
  const CpShare block = cp_expert_block(ctx, acts, ctx.ep_rank(), ctx.cp_rank());
  acts.rows.hidden_base = acts.rows.off[(size_t)block.first];
  const size_t computed = (size_t)(acts.rows.off[(size_t)(block.first + block.count)] - acts.rows.hidden_base);
  for (ops::DeviceVector<float>* v : {&acts.rows.u, &acts.rows.v, &acts.rows.sg}) grow(*v, computed * F);
  grow(acts.ye, (size_t)(ctx.tokens * ctx.cfg.top_k) * D);
  if (ctx.ep() > 1) {  // a pair moves at most the destination's slots per round
    size_t all_slots = 0;
    for (const RoundPlan& p : acts.plans) all_slots += (size_t)p.slots;
    grow(acts.rows.x, rows_held * D);
    grow(ws.send, all_slots * D);
    grow(ws.recv, all_slots * D);
  }
  count_moe_memory(ctx);
}

void exchange_expert_counts(StepContext& ctx, LayerActs& acts) {
  const int E = ctx.cfg.experts, ep = ctx.ep();
  acts.counts.resize((size_t)ep * E);
  std::vector<int64_t> mine(E);
  for (int e = 0; e < E; ++e) mine[e] = acts.expert_off[e + 1] - acts.expert_off[e];
  if (ep == 1) {
    std::copy(mine.begin(), mine.end(), acts.counts.begin());
    return;
  }
  std::vector<int64_t> out((size_t)ep * E);
  for (int d = 0; d < ep; ++d) std::copy(mine.begin(), mine.end(), out.begin() + (size_t)d * E);
  ep_all_to_all(ctx, out.data(), std::vector<size_t>(ep, E * 8), acts.counts.data(), std::vector<size_t>(ep, E * 8));
}

void exchange_leaf_ids(StepContext& ctx, LayerActs& acts) {
  const int E = ctx.cfg.experts, El = ctx.local_experts, ep = ctx.ep(), me = ctx.ep_rank();
  const int64_t NK = ctx.tokens * ctx.cfg.top_k;
  ExpertRows& rows = acts.rows;
  const int64_t rows_held = rows.off[El];
  rows.leaf.resize(rows_held);
  // A row's leaf in the EP group's order. Over several microbatches the owner keeps a tree per source data
  // rank over its whole step (ExpertGradsBySource): the source's leaves of every microbatch, consecutive.
  const int g = ctx.group(Axis::kExpertTokens).size();  // data ranks in the experts' batch
  const int64_t own_tokens = ctx.tokens / g, own_leaves = ctx.leaves / g;
  const bool by_source = ctx.grads_by_source();
  const auto leaf_of_token = [&](int64_t token) {
    if (!by_source) return (int64_t)me * ctx.leaves + token / ctx.leaf_tokens;
    const int64_t source = (int64_t)me * g + token / own_tokens;
    return (source * ctx.microbatches + ctx.microbatch) * own_leaves + token % own_tokens / ctx.leaf_tokens;
  };
  if (ep == 1) {
    for (int64_t row = 0; row < NK; ++row) rows.leaf[row] = leaf_of_token(acts.row_token[row]);
  } else {  // leaf ids in the EP group travel with the counts' layout: per destination, its experts' rows
    std::vector<int64_t> leaf_of(NK), leaf_in(rows_held);
    for (int64_t row = 0; row < NK; ++row) leaf_of[row] = leaf_of_token(acts.row_token[row]);
    std::vector<size_t> send_bytes(ep), recv_bytes(ep);
    for (int d = 0; d < ep; ++d) {
      send_bytes[d] = (size_t)(acts.expert_off[(d + 1) * El] - acts.expert_off[d * El]) * 8;
      for (int e = 0; e < El; ++e) recv_bytes[d] += (size_t)acts.counts[(size_t)d * E + me * El + e] * 8;
    }
    ep_all_to_all(ctx, leaf_of.data(), send_bytes, leaf_in.data(), recv_bytes);
    // Received source-major; the work order is expert-major.
    int64_t at = 0;
    std::vector<int64_t> fill(rows.off.begin(), rows.off.end() - 1);
    for (int src = 0; src < ep; ++src)
      for (int e = 0; e < El; ++e)
        for (int64_t i = 0; i < acts.counts[(size_t)src * E + me * El + e]; ++i) rows.leaf[fill[e]++] = leaf_in[at++];
  }
}

void send_round_inputs(StepContext& ctx, LayerActs& acts, int r) {
  exchange_rows(ctx, acts, r, ctx.cfg.d_model, /*to_owner=*/true, acts.batch_in,
                [&](int64_t disp) { return acts.row_token[disp]; }, ctx.ws.slots.x.data(),
                ctx.ep() > 1 ? acts.rows.x.data() : nullptr, nullptr);
}

RowPlace round_output_place(const StepContext& ctx, float* slots, float* dispatch_rows) {
  return ctx.ep() > 1 ? RowPlace{slots, true} : RowPlace{dispatch_rows, false};
}

void return_round_rows(StepContext& ctx, const LayerActs& acts, int r, const float* slots, float* dispatch_rows) {
  if (ctx.ep() > 1)
    exchange_rows(ctx, acts, r, ctx.cfg.d_model, /*to_owner=*/false, nullptr, nullptr, const_cast<float*>(slots),
                  nullptr, dispatch_rows);
}

void send_round_output_grads(StepContext& ctx, const LayerActs& acts, int r) {
  if (ctx.ep() > 1)
    exchange_rows(ctx, acts, r, ctx.cfg.d_model, /*to_owner=*/true, ctx.ws.dye.data(), [](int64_t disp) { return disp; },
                  ctx.ws.slots.dy.data(), nullptr, nullptr);
}

bool exchange_overlaps_shared_expert(const StepContext& ctx, const LayerActs& acts) {
  return ctx.mesh->overlap() && ctx.ep() > 1 && ctx.cfg.shared_expert && ctx.cp() == 1 && exchange_rounds(acts) > 0;
}

void start_return_round_rows(StepContext& ctx, const LayerActs& acts, int r, const float* slots, float* dispatch_rows) {
  exchange_rows(ctx, acts, r, ctx.cfg.d_model, /*to_owner=*/false, nullptr, nullptr, const_cast<float*>(slots),
                nullptr, dispatch_rows, /*start=*/true);
}

void start_round_output_grads(StepContext& ctx, const LayerActs& acts, int r) {
  exchange_rows(ctx, acts, r, ctx.cfg.d_model, /*to_owner=*/true, ctx.ws.dye.data(), [](int64_t disp) { return disp; },
                ctx.ws.slots.dy.data(), nullptr, nullptr, /*start=*/true);
}

void progress_round_exchange(StepContext& ctx) {
  if (ctx.ws.exchange_in_flight.pending) ctx.ws.exchange_in_flight.pending->test();
}

bool finish_round_exchange(StepContext& ctx) {
  StepWorkspace::ExchangeInFlight in_flight = std::move(ctx.ws.exchange_in_flight);
  ctx.ws.exchange_in_flight = {};
  if (!in_flight.pending) return false;
  in_flight.pending->wait();
  in_flight.unpack();
  return true;
}

void refill_round_inputs(StepContext& ctx, const LayerActs& acts, const RoundPlan& plan, int r) {
  StepWorkspace& ws = ctx.ws;
  const int D = ctx.cfg.d_model;
  if (ctx.ep() == 1) {
    exchange_rows(ctx, acts, r, D, true, acts.batch_in, [&](int64_t disp) { return acts.row_token[disp]; },
                  ws.slots.x.data(), nullptr, nullptr);
    return;
  }
  ops::synchronize();
  ws.from_row.clear();
  ws.to_row.clear();
  for (const Segment& s : plan.round[r])
    for (int64_t t = 0; t < s.rows; ++t) {
      ws.from_row.push_back(acts.rows.off[s.expert] + s.first + t);
      ws.to_row.push_back(s.slot + t);
    }
  ops::copy_rows(acts.rows.x.data(), ws.from_row.data(), ws.slots.x.data(), ws.to_row.data(), (int64_t)ws.to_row.size(),
                 D);
}

void ep_all_to_all(StepContext& ctx, const void* send, const std::vector<size_t>& send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes, Pending* started) {
  Communicator& group = ctx.group(Axis::kExpert);
  if (started) {
    *started = group.start_all_to_all(send, send_bytes, recv, recv_bytes);
    ++ctx.stats.all_to_all_started;
  } else {
    group.all_to_all(send, send_bytes, recv, recv_bytes);
  }
  ++ctx.stats.all_to_all_calls;
  for (size_t b : send_bytes) ctx.stats.all_to_all_bytes += (int64_t)b;
}

int exchange_rounds(const LayerActs& acts) {
  int r = 0;
  for (const RoundPlan& p : acts.plans) r = std::max(r, p.rounds());
  return r;
}

void exchange_rows(StepContext& ctx, const LayerActs& acts, int r, int width, bool to_owner, const float* src,
                   const std::function<int64_t(int64_t)>& src_index, float* slot_buf, float* keep, float* disp_out,
                   bool start) {
  const OpTimer op_timer(OpKind::kMoeDispatch);
  StepWorkspace& ws = ctx.ws;
  const int ep = ctx.ep(), El = ctx.local_experts, me = ctx.ep_rank();
  const RoundPlan& own = ctx.own_plan(acts);
  std::vector<int64_t>& first_row = ws.piece_first_row;
  std::vector<int64_t>& rows = ws.piece_rows;
  first_row.resize(El);
  rows.resize(El);
  ops::synchronize();  // the last copies may still read the index lists rebuilt here
  ws.from_row.clear();
  ws.to_row.clear();
  ws.keep_row.clear();
  if (ep == 1) {  // one source: straight between the dispatch rows and the slots
    if (r >= own.rounds()) return;
    for (int e = 0; e < El; ++e) first_row[e] = 0, rows[e] = own.load[e];
    for_each_piece(own, r, first_row.data(), rows.data(), [&](const Segment& s, int64_t lo, int64_t n) {
      for (int64_t t = 0; t < n; ++t) {
        const int64_t disp = acts.expert_off[s.expert] + lo + t, slot = s.slot + lo - s.first + t;
        ws.from_row.push_back(to_owner ? src_index(disp) : slot);
        ws.to_row.push_back(to_owner ? slot : disp);
      }
    });
    if (to_owner) ops::copy_rows(src, ws.from_row.data(), slot_buf, ws.to_row.data(), (int64_t)ws.to_row.size(), width);
    else ops::copy_rows(slot_buf, ws.from_row.data(), disp_out, ws.to_row.data(), (int64_t)ws.to_row.size(), width);
    return;
  }
  // At bf16 the rows sent to the experts' owner (x forward, dy backward) are
  // read there only as operands of bf16 products, which round them anyway:
  // they travel as bf16, half the bytes, and the bits are those of one rank.
  // The rows coming back (y, dx) are fp32 outputs and stay fp32.
  const bool bf16_rows = to_owner && bf16_matmuls();
  const size_t row_bytes = (bf16_rows ? sizeof(uint16_t) : sizeof(float)) * width;
  std::vector<size_t> send_bytes(ep, 0), recv_bytes(ep, 0);
  // Pack: a source walks each owner's pieces; an owner walks each source's.
  for (int d = 0; d < ep; ++d) {
    const RoundPlan& plan = to_owner ? acts.plans[d] : own;
    if (r >= plan.rounds()) continue;
    if (to_owner) source_part(ctx, acts, me, d, first_row.data(), rows.data());
    else source_part(ctx, acts, d, me, first_row.data(), rows.data());
    for_each_piece(plan, r, first_row.data(), rows.data(), [&](const Segment& s, int64_t lo, int64_t n) {
      for (int64_t t = 0; t < n; ++t)
        ws.from_row.push_back(to_owner ? src_index(acts.expert_off[d * El + s.expert] + lo - first_row[s.expert] + t)
                                       : s.slot + lo - s.first + t);
      send_bytes[d] += n * row_bytes;
    });
  }
  ops::copy_rows(to_owner ? src : slot_buf, ws.from_row.data(), ws.send.data(), nullptr, (int64_t)ws.from_row.size(),
                 width);
  if (bf16_rows) {
    ops::synchronize();
    pack_bf16_in_place(ws.send.data(), (int64_t)ws.from_row.size() * width);
  }
  // Unpack what arrives, in the sender's walk order.
  for (int d = 0; d < ep; ++d) {
    const RoundPlan& plan = to_owner ? own : acts.plans[d];
    if (r >= plan.rounds()) continue;
    if (to_owner) source_part(ctx, acts, d, me, first_row.data(), rows.data());
    else source_part(ctx, acts, me, d, first_row.data(), rows.data());
    for_each_piece(plan, r, first_row.data(), rows.data(), [&](const Segment& s, int64_t lo, int64_t n) {
      recv_bytes[d] += n * row_bytes;
      for (int64_t t = 0; t < n; ++t) {
        if (to_owner) {
          ws.to_row.push_back(s.slot + lo - s.first + t);
          ws.keep_row.push_back(acts.rows.off[s.expert] + lo + t);
        } else {
          ws.to_row.push_back(acts.expert_off[d * El + s.expert] + lo - first_row[s.expert] + t);
        }
      }
    });
  }
  ops::synchronize();  // the packed rows, read by the host's all-to-all
  // What arrives, into place (the index lists stay in ws until the next exchange).
  auto unpack = [&ws, to_owner, width, slot_buf, keep, disp_out, bf16_rows] {
    const OpTimer unpacking(OpKind::kMoeDispatch);
    const int64_t arrived = (int64_t)ws.to_row.size();
    if (bf16_rows) unpack_bf16_in_place(ws.recv.data(), arrived * width);
    if (to_owner) {
      ops::copy_rows(ws.recv.data(), nullptr, slot_buf, ws.to_row.data(), arrived, width);
      if (keep) ops::copy_rows(ws.recv.data(), nullptr, keep, ws.keep_row.data(), arrived, width);
    } else {
      ops::copy_rows(ws.recv.data(), nullptr, disp_out, ws.to_row.data(), arrived, width);
    }
  };
  // What these messages are (cluster/message_label.h): the group's other all-to-alls carry routing, not rows.
  const MessageLabel rows_of(to_owner ? "ep_dispatch" : "ep_return");
  if (!start) {
    ep_all_to_all(ctx, ws.send.data(), send_bytes, ws.recv.data(), recv_bytes);
    return unpack();
  }
  ep_all_to_all(ctx, ws.send.data(), send_bytes, ws.recv.data(), recv_bytes, &ws.exchange_in_flight.pending);
  ws.exchange_in_flight.unpack = unpack;
}

void count_moe_memory(StepContext& ctx) {
  const StepWorkspace& ws = ctx.ws;
  const ExpertSlots& sl = ws.slots;
  int64_t expert = 0, routed = 0, state = 0;
  for (const ops::DeviceVector<float>* v : {&sl.x, &sl.act, &sl.y, &sl.dy, &sl.dact, &sl.du, &sl.dv, &sl.dx})
    expert += held(*v);
  for (const LayerActs& acts : ws.layers)
    routed += held(acts.ye) + held(acts.rows.u) + held(acts.rows.v) + held(acts.rows.sg) + held(acts.rows.x) +
              held(acts.rows.leaf);
  for (const ops::DeviceVector<float>& v : ws.grad_state) state += held(v);
  MoeStats& st = ctx.stats;
  st.peak_expert_bytes = std::max(st.peak_expert_bytes, expert);
  st.peak_dispatch_bytes = std::max(st.peak_dispatch_bytes, held(ws.send) + held(ws.recv));
  st.peak_routed_bytes = std::max(st.peak_routed_bytes, routed);
  st.peak_grad_state_bytes = std::max(st.peak_grad_state_bytes, state);
}

namespace {

struct ExpertGrads {
  float *w1, *w3, *w2;
};
ExpertGrads expert_grads_of(const StepContext& ctx, int layer) {
  return {ctx.layer_grad(layer, "experts.w1"), ctx.layer_grad(layer, "experts.w3"),
          ctx.layer_grad(layer, "experts.w2")};
}

}  // namespace

void begin_expert_grads(StepContext& ctx, int layer, const RoundPlan& own, const ExpertRows& rows) {
  const int D = ctx.cfg.d_model, F = ctx.expert_d_ff_held(), ep = ctx.ep();  // ep: sources of an expert's rows
  if (!ctx.grads_by_source())
    ctx.ws.expert_grads.begin(own, rows, ctx.leaves * ep, D, F, &ctx.ws.grad_state);
  else if (ctx.microbatch == 0)  // a source data rank's leaves over the step
    (*ctx.source_grads)[(size_t)layer].begin(ctx.local_experts, ctx.expert_sources(),
                                             ctx.leaves / ctx.group(Axis::kExpertTokens).size() * ctx.microbatches, D, F);
}

void add_expert_grads(StepContext& ctx, int layer, const RoundPlan& own, int r, const ExpertRows& rows, RowPlace dy) {
  const ExpertSlots& slots = ctx.ws.slots;
  if (ctx.grads_by_source()) return (*ctx.source_grads)[(size_t)layer].add_round(own, r, slots, rows, dy);
  const ExpertGrads g = expert_grads_of(ctx, layer);
  ctx.ws.expert_grads.add_round(own, r, slots, rows, dy, g.w1, g.w3, g.w2);
}

void finish_expert_grads(StepContext& ctx, int layer, const LayerActs& acts) {
  const ExpertGrads g = expert_grads_of(ctx, layer);
  if (!ctx.grads_by_source()) {
    ctx.ws.expert_grads.finish(g.w1, g.w3, g.w2);
    ctx.stats.expert_gemm_calls += ctx.ws.expert_grads.calls();
  } else if (ctx.microbatch == ctx.microbatches - 1) {  // the step's gradients, once every microbatch is in
    ExpertGradsBySource& by_source = (*ctx.source_grads)[(size_t)layer];
    by_source.finish(g.w1, g.w3, g.w2);
    ctx.stats.expert_gemm_calls += by_source.calls();
    ctx.stats.peak_grad_state_bytes = std::max(ctx.stats.peak_grad_state_bytes, by_source.state_bytes());
  } else {
    return;
  }
  // Context parallel: each block's gradients folded whole on its rank, gathered.
  const int64_t per_expert = (int64_t)ctx.cfg.d_model * ctx.expert_d_ff_held();
  for (float* grad : {g.w1, g.w3, g.w2}) gather_expert_grads(ctx, acts, grad, per_expert);
}

void plan_owner_rounds(StepContext& ctx, LayerActs& acts) {
  const ModelConfig& c = ctx.cfg;
  const int E = c.experts, El = ctx.local_experts, ep = ctx.ep();
  acts.plans.resize(ep);
  for (int d = 0; d < ep; ++d) {
    std::vector<int64_t> load(El, 0);
    for (int src = 0; src < ep; ++src)
      for (int e = 0; e < El; ++e) load[e] += acts.counts[(size_t)src * E + d * El + e];
    acts.plans[d] = plan_rounds(c, load, ctx.tokens * (int64_t)ep);
  }
  const RoundPlan& own = ctx.own_plan(acts);
  acts.rows.off.assign(El + 1, 0);
  for (int e = 0; e < El; ++e) acts.rows.off[e + 1] = acts.rows.off[e] + own.load[e];
}

void gather_expert_batch(StepContext& ctx, LayerActs& acts) {
  Communicator& group = ctx.group(Axis::kExpertTokens);
  acts.batch_sel = acts.sel.data();
  acts.batch_in = acts.moe_in.data();
  if (group.size() == 1) return;
  const int g = group.size(), K = ctx.cfg.top_k, D = ctx.cfg.d_model;
  acts.batch_sel_all.resize(ctx.tokens * K * g);
  acts.batch_in_all.resize(ctx.tokens * D * g);
  ops::synchronize();  // the routing's outputs, read by the group
  all_gather_equal(group, acts.sel.data(), acts.batch_sel_all.data(), sizeof(int) * (size_t)(ctx.tokens * K));
  all_gather_equal(group, acts.moe_in.data(), acts.batch_in_all.data(), sizeof(float) * (size_t)(ctx.tokens * D));
  acts.batch_sel = acts.batch_sel_all.data();
  acts.batch_in = acts.batch_in_all.data();
}

StepContext& expert_batch(StepContext& ctx, std::optional<StepContext>& view) {
  const int g = ctx.group(Axis::kExpertTokens).size();
  if (g == 1) return ctx;
  view.emplace(ctx);
  view->tokens = ctx.tokens * g;
  view->leaves = ctx.leaves * g;
  view->batch = ctx.batch * g;
  return *view;
}

ops::DeviceVector<int64_t>& batch_rows_of(const StepContext& ctx, LayerActs& acts) {
  return ctx.group(Axis::kExpertTokens).size() == 1 ? acts.row_of : acts.batch_row_of_all;
}

void own_rows_of(const StepContext& ctx, LayerActs& acts) {
  Communicator& group = ctx.group(Axis::kExpertTokens);
  if (group.size() == 1) return;
  const int64_t NK = ctx.tokens * ctx.cfg.top_k, first = group.rank() * NK;
  acts.row_of.resize(NK);
  std::copy(acts.batch_row_of_all.data() + first, acts.batch_row_of_all.data() + first + NK, acts.row_of.data());
}

}  // namespace ls
