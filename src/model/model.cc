// The engine's forward and backward. Each block names the reference loop it
// must match bit for bit; threads split only independent outputs (tokens,
// heads, expert row blocks, weight-gradient column slabs), never a fold.
#include "model/model.h"
#include "common/op_profile.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>

#include "common/parallel.h"
#include "contract.h"
#include "ops/attention.h"
#include "ops/gemm.h"
#include "ops/ops.h"

namespace ls {

namespace {

std::vector<std::pair<std::string, std::vector<int64_t>>> shapes_for(const ModelConfig& c) {
  const int64_t V = c.vocab, D = c.d_model, F = c.d_ff, E = c.experts, T = c.seq_len;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out = {
      {"tok_emb", {V, D}}, {"pos_emb", {T, D}}, {"final_norm", {D}}, {"lm_head", {D, V}}};
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    out.push_back({p + "attn_norm", {D}});
    out.push_back({p + "wqkv", {D, 3 * D}});
    out.push_back({p + "wo", {D, D}});
    out.push_back({p + "moe_norm", {D}});
    out.push_back({p + "router", {D, E}});
    out.push_back({p + "experts.w1", {E, D, F}});
    out.push_back({p + "experts.w3", {E, D, F}});
    out.push_back({p + "experts.w2", {E, F, D}});
    if (c.shared_expert) {
      out.push_back({p + "shared.w1", {D, F}});
      out.push_back({p + "shared.w3", {D, F}});
      out.push_back({p + "shared.w2", {F, D}});
    }
  }
  std::sort(out.begin(), out.end());  // canonical (bytewise) name order
  return out;
}


// Bytes a vector holds allocated.
template <class T, class A> int64_t held(const std::vector<T, A>& v) { return (int64_t)(v.capacity() * sizeof(T)); }

// The source's part of each segment of an owner's round: the owner's
// expert e takes rows pre[e] .. pre[e] + cnt[e] - 1 (in its row order) from
// this source. fn(segment, first row of the piece in the expert's order,
// rows) in segment order, which both sides of an exchange walk alike.
template <class Fn>
void for_each_piece(const RoundPlan& plan, int r, const int64_t* pre, const int64_t* cnt, Fn&& fn) {
  for (const Segment& s : plan.round[r]) {
    const int64_t lo = std::max(s.first, pre[s.expert]), hi = std::min(s.first + s.rows, pre[s.expert] + cnt[s.expert]);
    if (lo < hi) fn(s, lo, hi - lo);
  }
}

}  // namespace

// Saved activations of one layer plus the routing of its tokens.
struct LayerActs {
  // Buffers ops read or write are DeviceVectors (ops/device_memory.h); the
  // rest is host bookkeeping.
  ops::DeviceVector<float> x, a, r1, qkv, att, o, xm, a2, r2, z, g, lse;
  ops::DeviceVector<int> sel;        // [N*K] expert of each (token, slot)
  ops::DeviceVector<int64_t> row_of;  // [N*K] row of (token, slot) in the expert buffers
  std::vector<int64_t> expert_off;   // [E+1] first row of each expert
  std::vector<int64_t> row_token;    // [N*K] token of each expert row
  std::vector<int64_t> global_counts;  // [E] assignments per expert over every data-parallel rank
  ops::DeviceVector<float> ye;       // expert outputs in dispatch order
  const float* ye_rows = nullptr;    // = ye.data()
  // The round schedule: plans[d] is EP rank d's (every rank knows every
  // owner's, to place its rows); counts[src * E + e]: rows of EP rank src
  // for expert e. Without expert parallelism: one plan, counts = the loads.
  std::vector<RoundPlan> plans;
  std::vector<int64_t> counts;
  ExpertRows rows;                   // the rows of the experts held here (from every rank of the EP group)
  ops::DeviceVector<float> su, sv, ssg, sact, ysh;  // shared expert
};

struct MoeTransformer::Workspace {
  int batch = -1;
  std::vector<LayerActs> layers;
  ops::DeviceVector<float> h, af, rf, logits, prob, lse, loss;
  // backward scratch
  ops::DeviceVector<float> dh, dtmp, dlogits, dye, du, dv, dact, dxe, dg, dz, da2, dO, dqkv, sdu, sdv, sdx;
  std::vector<float> trace_rows;  // expert rows regathered in (token, slot) order for the trace
  ops::DeviceVector<int> tok_id;     // [N] the input byte of each token
  ops::DeviceVector<int> target_id;  // [N] the next byte: each token's target
  ops::DeviceVector<int64_t> uniform_off;  // [leaves + 1] leaf offsets of whole leaves of tokens
  ops::DeviceVector<float> router_sums;    // [E + 1] ops::router_stats
  // MoE buffers sized by the schedule's capacity, reused by every round and layer.
  ExpertSlots slots;
  ops::DeviceVector<float> send, recv;            // expert parallel: one round's rows out and in
  ops::DeviceVector<int64_t> from_row, to_row;    // a round's row copies (ops::copy_rows): source and destination rows
  ops::DeviceVector<int64_t> keep_row;            // and, expert parallel, where each arriving row is kept
  ops::DeviceVector<float> row_vector;            // a vector added to every row (router skew, aux-loss gradient)
  std::vector<ops::DeviceVector<float>> grad_state;  // LeafFold state per (expert, gradient)
  ExpertWeightGrads expert_grads;                  // the backward's expert weight gradients, reused by every layer
};

MoeTransformer::MoeTransformer(const ModelConfig& cfg, int leaf_samples, uint64_t seed, int ep_size, int ep_rank)
    : cfg_(cfg), leaf_samples_(leaf_samples), ws_(new Workspace), ep_size_(ep_size), ep_rank_(ep_rank) {
  if (ep_size < 1 || cfg.experts % ep_size != 0)
    throw std::invalid_argument("engine: expert parallel size must divide the expert count");
  const int64_t local_experts = cfg.experts / ep_size;
  int64_t off = 0;
  for (auto& [name, shape] : shapes_for(cfg)) {
    ParamInfo p;
    p.name = name;
    p.global_shape = shape;
    p.shape = shape;
    p.expert = name.find(".experts.") != std::string::npos;
    int64_t global_size = 1;
    for (int64_t d : shape) global_size *= d;
    if (p.expert) {
      p.shape[0] = local_experts;
      p.global_offset = global_size / cfg.experts * local_experts * ep_rank;
    }
    p.size = 1;
    for (int64_t d : p.shape) p.size *= d;
    p.offset = off;
    p.decay = shape.size() > 1;
    off += p.size;
    infos_.push_back(p);
  }
  w_.resize(off);
  g_.assign(off, 0.0f);
  for (const ParamInfo& p : infos_) {
    float* w = w_.data() + p.offset;
    if (!p.decay) {
      std::fill(w, w + p.size, 1.0f);  // norm gains start at one
      continue;
    }
    const uint32_t id = tensor_id(p.name.c_str());
    parallel_for(p.size, [&](int64_t i) { w[i] = init_uniform(seed, id, (uint64_t)(p.global_offset + i), cfg.init_std); }, 65537);
  }
}

MoeTransformer::MoeTransformer(const MoeTransformer& main, LaneTag)
    : cfg_(main.cfg_), leaf_samples_(main.leaf_samples_), infos_(main.infos_), ws_(new Workspace),
      ep_size_(main.ep_size_), ep_rank_(main.ep_rank_) {
  g_.assign(main.w_.size(), 0.0f);
  wsrc_ = main.weights();
}

std::unique_ptr<MoeTransformer> MoeTransformer::lane_of(const MoeTransformer& main) {
  return std::unique_ptr<MoeTransformer>(new MoeTransformer(main, LaneTag{}));
}

MoeTransformer::~MoeTransformer() { delete ws_; }

const ParamInfo& MoeTransformer::param(const std::string& name) const {
  for (const ParamInfo& p : infos_)
    if (p.name == name) return p;
  throw std::out_of_range("engine: no parameter '" + name + "'");
}

int64_t count_weights(const ModelConfig& c, int ep_size) {
  int64_t n = 0;
  for (auto& [name, shape] : shapes_for(c)) {
    int64_t size = 1;
    for (int64_t d : shape) size *= d;
    n += name.find(".experts.") != std::string::npos ? size / ep_size : size;
  }
  return n;
}

// Keep in step with LayerActs, Workspace and the resize calls of run() and
// experts.cc; the memory test (tests/test_memory.cc) holds the sum to the
// measured peak RSS.
WorkspaceEstimate estimate_workspace(const ModelConfig& c, int batch, int ep_size) {
  const int64_t B = batch, S = c.seq_len, D = c.d_model, F = c.d_ff, E = c.experts, V = c.vocab, H = c.n_heads;
  const int64_t N = B * S, NK = N * c.top_k, L = c.n_layers;
  const int64_t f = sizeof(float), i64 = sizeof(int64_t);
  WorkspaceEstimate w;
  // Per layer: x, xm, a, o, a2 and qkv; attention probabilities; r1, r2, lse;
  // router logits and gates; routing indices; the shared expert.
  int64_t layer = (8 * N * D + B * H * ops::attention_probs_floats((int)S) + 3 * N + 2 * N * E) * f +
                  NK * (sizeof(int) + 2 * i64) + (2 * E + 1) * i64;
  if (c.shared_expert) layer += (4 * N * F + N * D) * f;
  // Whole-model scratch: h, af, dh, dtmp, da2, dO; dqkv; logits, prob, dlogits;
  // rf, lse, loss; dg, dz; dye, dxe; the shared expert's backward.
  int64_t scratch = (9 * N * D + 3 * N * V + 3 * N + 2 * N * E + 2 * NK * D) * f;
  if (c.shared_expert) scratch += (3 * N * F + N * D) * f;
  w.activations = L * layer + scratch;
  // Per layer, what is kept per routed row: outputs (D), u, v and sg (F),
  // the leaf id; with expert parallelism the received input row (D) too.
  const int64_t El = E / ep_size;
  w.expert_buffers = L * (NK * (D + 3 * F) * f + NK * i64);
  if (ep_size > 1) w.expert_buffers += L * NK * D * f;
  // The slots, capacity x local experts rows of x (D) and act, dact, du, dv
  // (F), plus y, dy, dx (D) with expert parallelism; shared by the layers.
  // peak reserves the busiest expert's load, which routing decides:
  // estimated at the mean load here.
  ModelConfig mean = c;
  if (c.moe_policy == MoePolicy::kPeak) mean.capacity_factor = 1.0f, mean.moe_capacity = 0;
  const int64_t slots = round_capacity(mean, N * ep_size) * El;
  w.expert_buffers += slots * ((ep_size > 1 ? 4 : 1) * D + 4 * F) * f;
  // Expert parallel: one round's send and receive buffers, every owner's slots each.
  if (ep_size > 1) w.dispatch_buffers = 2 * ep_size * slots * D * f;
  return w;
}

double train_flops_per_token(const ModelConfig& c) {
  const double D = c.d_model, F = c.d_ff, E = c.experts, K = c.top_k, V = c.vocab, S = c.seq_len;
  double per_layer = 2 * D * 3 * D + 2 * D * D + 2 * D * E   // qkv, out, router
                     + 2 * (S + 1) / 2 * D * 2               // causal scores and values
                     + K * 3 * 2 * D * F                     // routed SwiGLU experts
                     + (c.shared_expert ? 3 * 2 * D * F : 0);
  double fwd = c.n_layers * per_layer + 2 * D * V;
  return 3 * fwd;  // backward is about twice the forward
}

void MoeTransformer::set_moe_stats_from_lanes(const std::vector<const MoeStats*>& lanes) {
  MoeStats st;
  st.tokens_per_expert.assign((size_t)cfg_.n_layers * cfg_.experts, 0);
  for (const MoeStats* lane : lanes) {
    for (size_t i = 0; i < st.tokens_per_expert.size(); ++i) st.tokens_per_expert[i] += lane->tokens_per_expert[i];
    st.rounds = std::max(st.rounds, lane->rounds);
    st.borrowed += lane->borrowed;
    st.dropped += lane->dropped;
    st.expert_gemm_calls += lane->expert_gemm_calls;
    st.all_to_all_calls += lane->all_to_all_calls;
    st.all_to_all_bytes += lane->all_to_all_bytes;
    st.peak_expert_bytes = std::max(st.peak_expert_bytes, lane->peak_expert_bytes);
    st.peak_dispatch_bytes = std::max(st.peak_dispatch_bytes, lane->peak_dispatch_bytes);
    st.peak_routed_bytes = std::max(st.peak_routed_bytes, lane->peak_routed_bytes);
    st.peak_grad_state_bytes = std::max(st.peak_grad_state_bytes, lane->peak_grad_state_bytes);
  }
  stats_ = st;
}

StepLosses MoeTransformer::forward(const uint8_t* tokens, int batch) { return run(tokens, batch, false); }
StepLosses MoeTransformer::forward_backward(const uint8_t* tokens, int batch) { return run(tokens, batch, true); }


StepLosses MoeTransformer::run(const uint8_t* tokens, int B, bool backward) {
  const ModelConfig& c = cfg_;
  const int S = c.seq_len, D = c.d_model, H = c.n_heads, hd = D / H, E = c.experts, K = c.top_k, F = c.d_ff,
            V = c.vocab, L = c.n_layers;
  const int64_t N = (int64_t)B * S, NK = N * K;
  const int64_t leaf = (int64_t)leaf_samples_ * S, leaves = N / leaf;
  const int dp = mesh_ ? mesh_->dp_size() : 1, ep = mesh_ ? mesh_->ep_size() : 1;
  if (ep != ep_size_) throw std::logic_error("engine: mesh hooks disagree with the model's expert parallel size");
  const int El = E / ep;                              // experts held here
  const float Ng = (float)(N * dp), NKg = (float)(NK * dp);  // global token and assignment counts
  // This step's execution counts (the memory high-water marks persist).
  stats_.rounds = 0;
  stats_.borrowed = stats_.dropped = stats_.expert_gemm_calls = stats_.all_to_all_calls = stats_.all_to_all_bytes = 0;
  if (B % leaf_samples_ != 0)
    throw std::invalid_argument("engine: batch " + std::to_string(B) + " is not a multiple of numerics.leaf_samples");
  const float scale = 1.0f / ls::sqrt((float)hd);
  const int64_t probs = ops::attention_probs_floats(S);  // floats of one (sample, head)'s attention P
  Workspace& ws = *ws_;
  ops::synchronize();  // a kernel backend: the last step's kernels are done before the host rewrites inputs
  const float* wbase = wsrc_ ? wsrc_ : w_.data();
  auto W = [&](const std::string& name) { return wbase + param(name).offset; };
  auto G = [&](const std::string& name) { return g_.data() + param(name).offset; };
  auto lname = [](int l, const char* s) { return "layers." + std::to_string(l) + "." + s; };
  ops::DeviceVector<int64_t>& uniform_off = ws_->uniform_off;
  uniform_off.resize(leaves + 1);
  for (int64_t l = 0; l <= leaves; ++l) uniform_off[l] = l * leaf;
  auto tok = [&](int64_t n) { return (int)tokens[(n / S) * (S + 1) + n % S]; };
  auto target = [&](int64_t n) { return (int)tokens[(n / S) * (S + 1) + n % S + 1]; };

  if (ws.batch != B) {
    ws.layers.assign(L, LayerActs{});
    ws.batch = B;
  }
  TraceSink* tr = backward ? trace_ : nullptr;  // evaluation passes are not traced
  if (backward && phase_hook_) phase_hook_("forward");
  auto T = [&](const char* phase, int layer, const char* op, const char* name, const float* data,
               std::vector<int64_t> shape) {
    if (!tr) return;
    ops::synchronize();  // the host reads what kernels wrote
    tr->tensor(phase, layer, op, name, data, shape);
  };
  // Expert rows in (token, slot) order, the layout the reference keeps.
  auto token_slot_order = [&](const LayerActs& A, const float* rows, int width) -> const float* {
    ops::synchronize();
    ws.trace_rows.resize((size_t)NK * width);
    for (int64_t i = 0; i < NK; ++i)
      std::memcpy(&ws.trace_rows[i * width], &rows[A.row_of[i] * width], sizeof(float) * width);
    return ws.trace_rows.data();
  };
  if (tr)
    for (const ParamInfo& p : infos_) T("params", -1, "param", p.name.c_str(), wbase + p.offset, p.shape);
  stats_.tokens_per_expert.assign((size_t)L * E, 0);

  // The residual stream lives in the saved layer inputs: layer l reads A.x,
  // writes A.xm (after attention) and the next layer's x (ws.h after the last).
  ws.h.resize(N * D);
  for (LayerActs& A : ws.layers) {
    A.x.resize(N * D);
    A.xm.resize(N * D);
  }
  // Embedding: h = tok_emb[x] + pos_emb[t].
  {
    const float *te = W("tok_emb"), *pe = W("pos_emb");
    float* h0 = L > 0 ? ws.layers[0].x.data() : ws.h.data();
    ws.tok_id.resize(N);
    for (int64_t n = 0; n < N; ++n) ws.tok_id[n] = tok(n);
    ops::embed(ws.tok_id.data(), te, pe, h0, N, S, D);
  }

  // --- MoE helpers (docs/MOE.md)
  auto all_to_all = [&](const void* send, const std::vector<size_t>& sb, void* recv, const std::vector<size_t>& rb) {
    mesh_->ep_all_to_all(send, sb, recv, rb);
    ++stats_.all_to_all_calls;
    for (size_t b : sb) stats_.all_to_all_bytes += (int64_t)b;
  };
  // Exchanges are collective: every EP rank runs the most rounds any owner needs.
  auto exchange_rounds = [&](const LayerActs& A) {
    int r = 0;
    for (const RoundPlan& p : A.plans) r = std::max(r, p.rounds());
    return r;
  };
  // Source `src`'s rows of owner d's experts: pre[e] rows of earlier sources come first.
  auto source_part = [&](const LayerActs& A, int src, int d, int64_t* pre, int64_t* cnt) {
    for (int e = 0; e < El; ++e) {
      pre[e] = 0;
      for (int s2 = 0; s2 < src; ++s2) pre[e] += A.counts[(size_t)s2 * E + d * El + e];
      cnt[e] = A.counts[(size_t)src * E + d * El + e];
    }
  };
  // Round r's rows of `width` floats between the sources' dispatch order and
  // the owners' slots. to_owner: source row `disp` is row src_index(disp) of
  // src; the owner writes slot_buf (and, if keep, the row at its expert
  // position in keep). Back: the owner reads slot_buf and the source writes
  // disp_out[disp]. The rows move by ops::copy_rows over index lists built
  // here (one kernel per list on the CUDA backend).
  std::vector<int64_t> pre(El), cnt(El);
  auto exchange_rows = [&](const LayerActs& A, int r, int width, bool to_owner, const float* src,
                           const std::function<int64_t(int64_t)>& src_index, float* slot_buf, float* keep,
                           float* disp_out) {
    const OpTimer op_timer(OpKind::kMoeDispatch);
    const size_t row_bytes = sizeof(float) * width;
    const int me = ep > 1 ? mesh_->ep_rank() : 0;
    const RoundPlan& own = A.plans[me];
    ops::synchronize();  // the last copies may still read the index lists rebuilt here
    ws.from_row.clear();
    ws.to_row.clear();
    ws.keep_row.clear();
    if (ep == 1) {  // one source: straight between the dispatch rows and the slots
      if (r >= own.rounds()) return;
      for (int e = 0; e < El; ++e) pre[e] = 0, cnt[e] = own.load[e];
      for_each_piece(own, r, pre.data(), cnt.data(), [&](const Segment& s, int64_t lo, int64_t n) {
        for (int64_t t = 0; t < n; ++t) {
          const int64_t disp = A.expert_off[s.expert] + lo + t, slot = s.slot + lo - s.first + t;
          ws.from_row.push_back(to_owner ? src_index(disp) : slot);
          ws.to_row.push_back(to_owner ? slot : disp);
        }
      });
      if (to_owner) ops::copy_rows(src, ws.from_row.data(), slot_buf, ws.to_row.data(), (int64_t)ws.to_row.size(), width);
      else ops::copy_rows(slot_buf, ws.from_row.data(), disp_out, ws.to_row.data(), (int64_t)ws.to_row.size(), width);
      return;
    }
    std::vector<size_t> sb(ep, 0), rb(ep, 0);
    // Pack: a source walks each owner's pieces; an owner walks each source's.
    for (int d = 0; d < ep; ++d) {
      const RoundPlan& plan = to_owner ? A.plans[d] : own;
      if (r >= plan.rounds()) continue;
      if (to_owner) source_part(A, me, d, pre.data(), cnt.data());
      else source_part(A, d, me, pre.data(), cnt.data());
      for_each_piece(plan, r, pre.data(), cnt.data(), [&](const Segment& s, int64_t lo, int64_t n) {
        for (int64_t t = 0; t < n; ++t)
          ws.from_row.push_back(to_owner ? src_index(A.expert_off[d * El + s.expert] + lo - pre[s.expert] + t)
                                         : s.slot + lo - s.first + t);
        sb[d] += n * row_bytes;
      });
    }
    ops::copy_rows(to_owner ? src : slot_buf, ws.from_row.data(), ws.send.data(), nullptr,
                   (int64_t)ws.from_row.size(), width);
    // Unpack what arrives, in the sender's walk order.
    for (int d = 0; d < ep; ++d) {
      const RoundPlan& plan = to_owner ? own : A.plans[d];
      if (r >= plan.rounds()) continue;
      if (to_owner) source_part(A, d, me, pre.data(), cnt.data());
      else source_part(A, me, d, pre.data(), cnt.data());
      for_each_piece(plan, r, pre.data(), cnt.data(), [&](const Segment& s, int64_t lo, int64_t n) {
        rb[d] += n * row_bytes;
        for (int64_t t = 0; t < n; ++t) {
          if (to_owner) {
            ws.to_row.push_back(s.slot + lo - s.first + t);
            ws.keep_row.push_back(A.rows.off[s.expert] + lo + t);
          } else {
            ws.to_row.push_back(A.expert_off[d * El + s.expert] + lo - pre[s.expert] + t);
          }
        }
      });
    }
    ops::synchronize();  // the packed rows, read by the host's all-to-all
    all_to_all(ws.send.data(), sb, ws.recv.data(), rb);
    const int64_t arrived = (int64_t)ws.to_row.size();
    if (to_owner) {
      ops::copy_rows(ws.recv.data(), nullptr, slot_buf, ws.to_row.data(), arrived, width);
      if (keep) ops::copy_rows(ws.recv.data(), nullptr, keep, ws.keep_row.data(), arrived, width);
    } else {
      ops::copy_rows(ws.recv.data(), nullptr, disp_out, ws.to_row.data(), arrived, width);
    }
  };
  // Buffers only grow, each to exactly what is asked (so what is counted is
  // what the plans asked for), and are counted as allocated.
  auto grow = [](ops::DeviceVector<float>& v, size_t n) {
    if (v.size() >= n) return;
    if (v.capacity() < n) ops::DeviceVector<float>(n).swap(v);
    else v.resize(n);
  };
  auto count_moe_memory = [&]() {
    const ExpertSlots& sl = ws.slots;
    int64_t expert = 0, routed = 0, state = 0;
    for (const ops::DeviceVector<float>* v : {&sl.x, &sl.act, &sl.y, &sl.dy, &sl.dact, &sl.du, &sl.dv, &sl.dx})
      expert += held(*v);
    for (const LayerActs& A : ws.layers)
      routed += held(A.ye) + held(A.rows.u) + held(A.rows.v) + held(A.rows.sg) + held(A.rows.x) + held(A.rows.leaf);
    for (const ops::DeviceVector<float>& v : ws.grad_state) state += held(v);
    stats_.peak_expert_bytes = std::max(stats_.peak_expert_bytes, expert);
    stats_.peak_dispatch_bytes = std::max(stats_.peak_dispatch_bytes, held(ws.send) + held(ws.recv));
    stats_.peak_routed_bytes = std::max(stats_.peak_routed_bytes, routed);
    stats_.peak_grad_state_bytes = std::max(stats_.peak_grad_state_bytes, state);
  };
  auto hold_moe_buffers = [&](LayerActs& A) {
    const RoundPlan& own = A.plans[ep > 1 ? mesh_->ep_rank() : 0];
    const size_t S = (size_t)own.slots;
    // Without expert parallelism y, dy and dx live in the dispatch rows: no slots for them.
    grow(ws.slots.x, S * D);
    if (ep > 1)
      for (ops::DeviceVector<float>* v : {&ws.slots.y, &ws.slots.dy, &ws.slots.dx}) grow(*v, S * D);
    for (ops::DeviceVector<float>* v : {&ws.slots.act, &ws.slots.dact, &ws.slots.du, &ws.slots.dv}) grow(*v, S * F);
    const size_t held_rows = (size_t)A.rows.off[El];
    for (ops::DeviceVector<float>* v : {&A.rows.u, &A.rows.v, &A.rows.sg}) grow(*v, held_rows * F);
    grow(A.ye, (size_t)NK * D);
    if (ep > 1) {  // a pair moves at most the destination's slots per round
      size_t all_slots = 0;
      for (const RoundPlan& p : A.plans) all_slots += (size_t)p.slots;
      grow(A.rows.x, held_rows * D);
      grow(ws.send, all_slots * D);
      grow(ws.recv, all_slots * D);
    }
    count_moe_memory();
  };

  std::vector<float> aux_l(L, 0.0f), z_l(L, 0.0f);
  for (int l = 0; l < L; ++l) {
    LayerActs& A = ws.layers[l];
    const float *attn_norm = W(lname(l, "attn_norm")), *wqkv = W(lname(l, "wqkv")), *wo = W(lname(l, "wo")),
                *moe_norm = W(lname(l, "moe_norm")), *router = W(lname(l, "router")),
                *W1 = W(lname(l, "experts.w1")), *W3 = W(lname(l, "experts.w3")), *W2 = W(lname(l, "experts.w2"));
    float* hout = l + 1 < L ? ws.layers[l + 1].x.data() : ws.h.data();  // this layer's output
    // --- attention block
    A.a.resize(N * D);
    A.r1.resize(N);
    ops::rmsnorm(A.x.data(), attn_norm, A.a.data(), A.r1.data(), N, D, c.rms_eps);
    T("fwd", l, "attn_norm", "out", A.a.data(), {N, D});
    A.qkv.resize(N * 3 * D);
    ops::linear(A.a.data(), N, D, wqkv, 3 * D, A.qkv.data());
    T("fwd", l, "qkv", "out", A.qkv.data(), {N, 3 * D});
    A.att.resize((size_t)B * H * probs);
    A.o.resize(N * D);
    ops::attention_forward_heads(A.qkv.data(), B, H, S, hd, scale, A.att.data(), A.o.data());
    T("fwd", l, "attention", "out", A.o.data(), {N, D});
    ws.dtmp.resize(N * D);
    ops::linear(A.o.data(), N, D, wo, D, ws.dtmp.data());
    ops::add(A.x.data(), ws.dtmp.data(), A.xm.data(), N * D);
    T("fwd", l, "attn_residual", "h", A.xm.data(), {N, D});

    // --- MoE block: route
    A.a2.resize(N * D);
    A.r2.resize(N);
    if (debug_reorder_moe_norm_)
      ops::rmsnorm_debug_reversed(A.xm.data(), moe_norm, A.a2.data(), A.r2.data(), N, D, c.rms_eps);
    else
      ops::rmsnorm(A.xm.data(), moe_norm, A.a2.data(), A.r2.data(), N, D, c.rms_eps);
    T("fwd", l, "moe_norm", "out", A.a2.data(), {N, D});
    A.z.resize(N * E);
    A.g.resize(N * E);
    A.lse.resize(N);
    A.sel.resize(NK);
    ops::linear(A.a2.data(), N, D, router, E, A.z.data());
    if (c.router_skew != 0) {  // a fixed preference for the first max(1, E/4) experts
      ops::synchronize();
      ws.row_vector.assign(std::max(1, E / 4), c.router_skew);
      ops::add_row_vector(A.z.data(), N, E, std::max(1, E / 4), ws.row_vector.data());
    }
    ops::softmax_rows(A.z.data(), E, A.g.data(), E, (int)N, E, 0, A.lse.data());
    ops::route_topk(A.g.data(), N, E, K, A.sel.data());
    ops::synchronize();  // the host plans the rounds from the routing choices
    T("fwd", l, "router", "logits", A.z.data(), {N, E});
    T("fwd", l, "router", "gates", A.g.data(), {N, E});
    // Dispatch: rows grouped by expert, in token order inside each expert.
    A.expert_off.assign(E + 1, 0);
    for (int64_t i = 0; i < NK; ++i) ++A.expert_off[A.sel[i] + 1];
    for (int e = 0; e < E; ++e) {
      stats_.tokens_per_expert[(size_t)l * E + e] = A.expert_off[e + 1];
      A.expert_off[e + 1] += A.expert_off[e];
    }
    A.row_of.resize(NK);
    A.row_token.resize(NK);
    {
      std::vector<int64_t> fill(A.expert_off.begin(), A.expert_off.end() - 1);
      for (int64_t n = 0; n < N; ++n)
        for (int s = 0; s < K; ++s) {
          const int64_t row = fill[A.sel[n * K + s]]++;
          A.row_of[n * K + s] = row;
          A.row_token[row] = n;
        }
    }
    // The rows of the experts held here (docs/MOE.md): local rows, or every
    // EP rank's rows for our experts, ordered by expert, then source rank,
    // then token: the global token order, as the source ranks hold
    // consecutive samples. Every rank learns every rank's counts, so sources
    // and owners derive the same round plans.
    ExpertRows& X = A.rows;
    const int me = ep > 1 ? mesh_->ep_rank() : 0;
    A.counts.resize((size_t)ep * E);
    if (ep == 1) {
      for (int e = 0; e < E; ++e) A.counts[e] = A.expert_off[e + 1] - A.expert_off[e];
    } else {
      std::vector<int64_t> mine(E), out((size_t)ep * E);
      for (int e = 0; e < E; ++e) mine[e] = A.expert_off[e + 1] - A.expert_off[e];
      for (int d = 0; d < ep; ++d) std::copy(mine.begin(), mine.end(), out.begin() + (size_t)d * E);
      all_to_all(out.data(), std::vector<size_t>(ep, E * 8), A.counts.data(), std::vector<size_t>(ep, E * 8));
    }
    A.plans.resize(ep);
    for (int d = 0; d < ep; ++d) {
      std::vector<int64_t> load(El, 0);
      for (int src = 0; src < ep; ++src)
        for (int e = 0; e < El; ++e) load[e] += A.counts[(size_t)src * E + d * El + e];
      A.plans[d] = plan_rounds(c, load, N * (int64_t)ep);
    }
    const RoundPlan& P = A.plans[me];
    X.off.assign(El + 1, 0);
    for (int e = 0; e < El; ++e) X.off[e + 1] = X.off[e] + P.load[e];
    const int64_t held_rows = X.off[El];
    X.leaf.resize(held_rows);
    if (ep == 1) {
      for (int64_t row = 0; row < NK; ++row) X.leaf[row] = A.row_token[row] / leaf;
    } else {  // leaf ids in the EP group travel with the counts' layout: per destination, its experts' rows
      std::vector<int64_t> leaf_of(NK), leaf_in(held_rows);
      for (int64_t row = 0; row < NK; ++row) leaf_of[row] = (int64_t)me * leaves + A.row_token[row] / leaf;
      std::vector<size_t> sb(ep), rb(ep);
      for (int d = 0; d < ep; ++d) {
        sb[d] = (size_t)(A.expert_off[(d + 1) * El] - A.expert_off[d * El]) * 8;
        for (int e = 0; e < El; ++e) rb[d] += (size_t)A.counts[(size_t)d * E + me * El + e] * 8;
      }
      all_to_all(leaf_of.data(), sb, leaf_in.data(), rb);
      // Received source-major; the work order is expert-major.
      int64_t at = 0;
      std::vector<int64_t> fill(X.off.begin(), X.off.end() - 1);
      for (int src = 0; src < ep; ++src)
        for (int e = 0; e < El; ++e)
          for (int64_t i = 0; i < A.counts[(size_t)src * E + me * El + e]; ++i) X.leaf[fill[e]++] = leaf_in[at++];
    }
    hold_moe_buffers(A);
    if (c.moe_policy == MoePolicy::kDrop) ops::fill(A.ye.data(), (int64_t)A.ye.size(), 0.0f);  // skipped rows give 0
    for (int r = 0; r < exchange_rounds(A); ++r) {
      exchange_rows(A, r, D, /*to_owner=*/true, A.a2.data(), [&](int64_t disp) { return A.row_token[disp]; },
                    ws.slots.x.data(), ep > 1 ? X.x.data() : nullptr, nullptr);
      // Without expert parallelism the outputs go straight to the dispatch rows the combine reads.
      const RowPlace y = ep > 1 ? RowPlace{ws.slots.y.data(), true} : RowPlace{A.ye.data(), false};
      if (r < P.rounds()) stats_.expert_gemm_calls += experts_round_forward(P, r, ws.slots, X, y, W1, W3, W2, D, F);
      if (ep > 1) exchange_rows(A, r, D, /*to_owner=*/false, nullptr, nullptr, ws.slots.y.data(), nullptr, A.ye.data());
    }
    stats_.rounds = std::max(stats_.rounds, P.rounds());
    stats_.borrowed += P.borrowed;
    stats_.dropped += P.dropped;
    A.ye_rows = A.ye.data();
    if (tr) T("fwd", l, "moe.experts", "out", token_slot_order(A, A.ye_rows, D), {N, K, D});
    if (c.shared_expert) {
      A.su.resize(N * F);
      A.sv.resize(N * F);
      A.ssg.resize(N * F);
      A.sact.resize(N * F);
      A.ysh.resize(N * D);
      ops::linear(A.a2.data(), N, D, W(lname(l, "shared.w1")), F, A.su.data());
      ops::linear(A.a2.data(), N, D, W(lname(l, "shared.w3")), F, A.sv.data());
      ops::swiglu(A.su.data(), A.sv.data(), A.ssg.data(), A.sact.data(), N * F);
      ops::linear(A.sact.data(), N, F, W(lname(l, "shared.w2")), D, A.ysh.data());
    }
    // Combine: out = fold over slots of fma(gate, y_slot, out) from +0, then + shared.
    ops::moe_combine(A.g.data(), E, A.sel.data(), K, A.row_of.data(), A.ye_rows, c.shared_expert ? A.ysh.data() : nullptr,
                     A.xm.data(), hout, N, D);
    T("fwd", l, "moe.combine", "h", hout, {N, D});
    // Load balancing (E * sum_e f_e P_e) and z-loss (mean lse^2): token reductions.
    {
      // This rank's subtrees (ops::router_stats), then the canonical tree over ranks.
      ops::DeviceVector<float>& sums = ws.router_sums;
      sums.resize(E + 1);
      ops::router_stats(A.g.data(), A.lse.data(), N, E, leaf, leaves, sums.data());
      ops::synchronize();  // read by the host (and the mesh's sum)
      A.global_counts.resize(E);
      for (int e = 0; e < E; ++e) A.global_counts[e] = A.expert_off[e + 1] - A.expert_off[e];
      if (mesh_) {
        mesh_->sum_partials(sums.data(), sums.size());
        mesh_->sum_counts(A.global_counts.data(), E);
      }
      float dot = 0.0f;  // reduces over the expert index e
      for (int e = 0; e < E; ++e) {
        const float f = (float)A.global_counts[e] / NKg;
        const float Pe = sums[e] / Ng;
        dot = ls::fma(f, Pe, dot);
      }
      aux_l[l] = (float)E * dot;
      z_l[l] = sums[E] / Ng;
    }
  }

  // Final norm, head, cross-entropy.
  const float *final_norm = W("final_norm"), *lm_head = W("lm_head");
  ws.af.resize(N * D);
  ws.rf.resize(N);
  ws.logits.resize(N * V);
  ws.prob.resize(N * V);
  ws.lse.resize(N);
  ws.loss.resize(N);
  ops::rmsnorm(ws.h.data(), final_norm, ws.af.data(), ws.rf.data(), N, D, c.rms_eps);
  T("fwd", -1, "final_norm", "out", ws.af.data(), {N, D});
  ops::linear(ws.af.data(), N, D, lm_head, V, ws.logits.data());
  T("fwd", -1, "lm_head", "logits", ws.logits.data(), {N, V});
  ws.target_id.resize(N);
  for (int64_t n = 0; n < N; ++n) ws.target_id[n] = target(n);
  ops::softmax_rows(ws.logits.data(), V, ws.prob.data(), V, (int)N, V, 0, ws.lse.data());
  ops::token_losses(ws.lse.data(), ws.logits.data(), ws.target_id.data(), N, V, ws.loss.data());
  T("fwd", -1, "loss", "per_token", ws.loss.data(), {N});
  StepLosses out;
  {
    float ce_sum = ops::token_sum(ws.loss.data(), N, leaf);  // this rank's subtree
    if (mesh_) mesh_->sum_partials(&ce_sum, 1);
    out.ce = ce_sum / Ng;
  }
  for (int l = 0; l < L; ++l) out.aux = out.aux + aux_l[l];
  for (int l = 0; l < L; ++l) out.z = out.z + z_l[l];
  out.total = out.ce + c.aux_loss_weight * out.aux + c.z_loss_weight * out.z;
  if (!backward) {
    ops::synchronize();
    return out;
  }

  // ------------------------------------------------------------ backward --
  if (phase_hook_) phase_hook_("backward");
  ws.dlogits.resize(N * V);
  ops::cross_entropy_grad(ws.prob.data(), ws.target_id.data(), N, V, Ng, ws.dlogits.data());
  T("bwd", -1, "lm_head", "dlogits", ws.dlogits.data(), {N, V});
  ops::weight_grad(ws.af.data(), D, ws.dlogits.data(), V, D, V, uniform_off.data(), leaves, G("lm_head"));
  ws.dtmp.resize(N * D);
  ws.dh.resize(N * D);
  ops::linear_input_grad(ws.dlogits.data(), N, V, lm_head, D, ws.dtmp.data(), false);
  ops::rmsnorm_weight_grad(ws.h.data(), ws.rf.data(), ws.dtmp.data(), N, D, leaf, G("final_norm"));
  ops::rmsnorm_backward(ws.h.data(), final_norm, ws.rf.data(), ws.dtmp.data(), ws.dh.data(), N, D, false);
  T("bwd", -1, "final_norm", "dh", ws.dh.data(), {N, D});

  for (int l = L - 1; l >= 0; --l) {
    LayerActs& A = ws.layers[l];
    const float *attn_norm = W(lname(l, "attn_norm")), *wqkv = W(lname(l, "wqkv")), *wo = W(lname(l, "wo")),
                *moe_norm = W(lname(l, "moe_norm")), *router = W(lname(l, "router")),
                *W1 = W(lname(l, "experts.w1")), *W3 = W(lname(l, "experts.w3")), *W2 = W(lname(l, "experts.w2"));
    float *gW1 = G(lname(l, "experts.w1")), *gW3 = G(lname(l, "experts.w3")), *gW2 = G(lname(l, "experts.w2"));
    // --- MoE block. dh is the gradient of the block output.
    ws.dye.resize(NK * D);
    ws.dg.resize(N * E);
    ops::fill(ws.dg.data(), N * E, 0.0f);
    ops::moe_combine_backward(ws.dh.data(), A.g.data(), E, A.sel.data(), K, A.row_of.data(), A.ye_rows, ws.dg.data(),
                              ws.dye.data(), N, D);
    // Backward in the forward's rounds and slots; the weight-gradient leaf
    // trees continue from round to round.
    ExpertRows& X = A.rows;
    const RoundPlan& P = A.plans[ep > 1 ? mesh_->ep_rank() : 0];
    ws.dxe.resize(NK * D);
    if (c.moe_policy == MoePolicy::kDrop) ops::fill(ws.dxe.data(), NK * D, 0.0f);  // skipped rows: no gradient
    ExpertWeightGrads& grads = ws.expert_grads;  // kept: its buffers are reused layer to layer
    grads.begin(P, X, leaves * ep, D, F, &ws.grad_state);
    count_moe_memory();
    // Without expert parallelism dy and dx stay in the dispatch rows (the experts' row order).
    const RowPlace dy = ep > 1 ? RowPlace{ws.slots.dy.data(), true} : RowPlace{ws.dye.data(), false};
    const RowPlace dx = ep > 1 ? RowPlace{ws.slots.dx.data(), true} : RowPlace{ws.dxe.data(), false};
    for (int r = 0; r < exchange_rounds(A); ++r) {
      if (ep > 1)
        exchange_rows(A, r, D, /*to_owner=*/true, ws.dye.data(), [](int64_t disp) { return disp; },
                      ws.slots.dy.data(), nullptr, nullptr);
      if (r < P.rounds()) {
        // The inputs again, into the same slots: from the layer's input rows
        // (kept per row with expert parallelism).
        if (ep == 1) {
          exchange_rows(A, r, D, true, A.a2.data(), [&](int64_t disp) { return A.row_token[disp]; },
                        ws.slots.x.data(), nullptr, nullptr);
        } else {
          ops::synchronize();
          ws.from_row.clear();
          ws.to_row.clear();
          for (const Segment& s : P.round[r])
            for (int64_t t = 0; t < s.rows; ++t) {
              ws.from_row.push_back(X.off[s.expert] + s.first + t);
              ws.to_row.push_back(s.slot + t);
            }
          ops::copy_rows(X.x.data(), ws.from_row.data(), ws.slots.x.data(), ws.to_row.data(),
                         (int64_t)ws.to_row.size(), D);
        }
        stats_.expert_gemm_calls += experts_round_backward(P, r, ws.slots, X, dy, dx, W1, W3, W2, D, F);
        grads.add_round(P, r, ws.slots, X, dy, gW1, gW3, gW2);
      }
      if (ep > 1) exchange_rows(A, r, D, /*to_owner=*/false, nullptr, nullptr, ws.slots.dx.data(), nullptr, ws.dxe.data());
    }
    grads.finish(gW1, gW3, gW2);
    stats_.expert_gemm_calls += grads.calls();
    const float* dxe = ws.dxe.data();  // dispatch order
    if (tr) T("bwd", l, "moe.experts", "dx", token_slot_order(A, dxe, D), {N, K, D});
    // da2 = (sum over slots, in slot order, from +0) + shared + router part.
    ws.da2.resize(N * D);
    ops::slot_sum(dxe, A.row_of.data(), K, N, D, ws.da2.data());
    if (c.shared_expert) {
      const float *s1 = W(lname(l, "shared.w1")), *s3 = W(lname(l, "shared.w3")), *s2 = W(lname(l, "shared.w2"));
      ws.sdu.resize(N * F);
      ws.sdv.resize(N * F);
      ws.sdx.resize(N * D);
      ws.dact.resize(N * F);
      ops::linear_input_grad(ws.dh.data(), N, D, s2, F, ws.dact.data(), false);
      ops::swiglu_backward(A.su.data(), A.sv.data(), A.ssg.data(), ws.dact.data(), ws.sdu.data(), ws.sdv.data(), N * F);
      ops::linear_input_grad(ws.sdu.data(), N, F, s1, D, ws.sdx.data(), false);
      ops::linear_input_grad(ws.sdv.data(), N, F, s3, D, ws.sdx.data(), true);
      ops::weight_grad(A.a2.data(), D, ws.sdu.data(), F, D, F, uniform_off.data(), leaves, G(lname(l, "shared.w1")));
      ops::weight_grad(A.a2.data(), D, ws.sdv.data(), F, D, F, uniform_off.data(), leaves, G(lname(l, "shared.w3")));
      ops::weight_grad(A.sact.data(), F, ws.dh.data(), D, F, D, uniform_off.data(), leaves, G(lname(l, "shared.w2")));
      ops::add(ws.da2.data(), ws.sdx.data(), ws.da2.data(), N * D);
    }
    // Router: combine gradient + aux term (counts are constants), softmax
    // backward, + z-loss term.
    {
      ops::synchronize();
      ws.row_vector.resize(E);
      for (int e = 0; e < E; ++e) {
        const float f = (float)A.global_counts[e] / NKg;
        ws.row_vector[e] = ((c.aux_loss_weight * (float)E) * f) / Ng;
      }
      ws.dz.resize(N * E);
      ops::add_row_vector(ws.dg.data(), N, E, E, ws.row_vector.data());
      ops::softmax_backward_rows(A.g.data(), E, ws.dg.data(), E, ws.dz.data(), E, (int)N, E, 0);
      ops::z_loss_grad(A.g.data(), A.lse.data(), N, E, c.z_loss_weight * 2.0f, Ng, ws.dz.data());
      T("bwd", l, "router", "dz", ws.dz.data(), {N, E});
      ops::weight_grad(A.a2.data(), D, ws.dz.data(), E, D, E, uniform_off.data(), leaves, G(lname(l, "router")));
      ops::linear_input_grad(ws.dz.data(), N, E, router, D, ws.dtmp.data(), false);
      ops::add(ws.da2.data(), ws.dtmp.data(), ws.da2.data(), N * D);
    }
    ops::rmsnorm_weight_grad(A.xm.data(), A.r2.data(), ws.da2.data(), N, D, leaf, G(lname(l, "moe_norm")));
    ops::rmsnorm_backward(A.xm.data(), moe_norm, A.r2.data(), ws.da2.data(), ws.dh.data(), N, D, true);
    T("bwd", l, "moe_norm", "dh", ws.dh.data(), {N, D});

    // --- attention block. dh is the gradient of the block output.
    ops::weight_grad(A.o.data(), D, ws.dh.data(), D, D, D, uniform_off.data(), leaves, G(lname(l, "wo")));
    ws.dO.resize(N * D);
    ops::linear_input_grad(ws.dh.data(), N, D, wo, D, ws.dO.data(), false);
    ws.dqkv.resize(N * 3 * D);
    ops::attention_backward_heads(A.qkv.data(), B, H, S, hd, scale, A.att.data(), ws.dO.data(), ws.dqkv.data());
    T("bwd", l, "attention", "dqkv", ws.dqkv.data(), {N, 3 * D});
    ops::weight_grad(A.a.data(), D, ws.dqkv.data(), 3 * D, D, 3 * D, uniform_off.data(), leaves, G(lname(l, "wqkv")));
    ops::linear_input_grad(ws.dqkv.data(), N, 3 * D, wqkv, D, ws.dtmp.data(), false);
    ops::rmsnorm_weight_grad(A.x.data(), A.r1.data(), ws.dtmp.data(), N, D, leaf, G(lname(l, "attn_norm")));
    ops::rmsnorm_backward(A.x.data(), attn_norm, A.r1.data(), ws.dtmp.data(), ws.dh.data(), N, D, true);
    T("bwd", l, "attn_norm", "dh", ws.dh.data(), {N, D});
  }

  // Embedding gradients (ops::embedding_grad): per leaf, the tokens' dh with
  // that byte (or position), in token order; leaves by the canonical tree.
  ops::embedding_grad(ws.tok_id.data(), ws.dh.data(), N, S, D, V, leaf, leaves, G("tok_emb"), G("pos_emb"));
  if (tr)
    for (const ParamInfo& p : infos_) T("grad", -1, "param", p.name.c_str(), g_.data() + p.offset, p.shape);
  ops::synchronize();  // the gradients are done: the trainer's collectives and optimizer may read them
  return out;
}

}  // namespace ls
