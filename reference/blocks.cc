// The reference blocks: every equation as a plain loop, in the order the
// numerics contract fixes. Comments at each reduction name its index.
#include "blocks.h"

#include <algorithm>
#include <cmath>

#include "contract.h"
#include "ops.h"

namespace ref {

namespace {

template <class T>
Param<T>& layer_param(Model<T>& m, int l, const char* name) {
  return m.param("layers." + std::to_string(l) + "." + name);
}

// A tensor to the model's trace (float model, training passes only).
template <class T>
void trace(Model<T>& m, const Step<T>& st, const char* phase, int layer, const char* op, const char* name,
           const std::vector<T>& data, std::vector<int64_t> shape) {
  if constexpr (sizeof(T) == sizeof(float))
    if (st.training && m.trace) m.trace(phase, layer, op, name, data.data(), shape);
}

template <class T>
std::vector<T>& layer_output(Step<T>& st, int l) {
  return l + 1 < (int)st.layers.size() ? st.layers[l + 1].x : st.h;
}

// Weight gradient: dW[i][j] = sum over tokens of X[n][i] * dY[n][j]
// (reduces over the global token index: fma fold per leaf, canonical tree).
// At bf16, unless fp32 (the router's), each leaf's fold is the bf16 fold
// (token_product_reduce).
template <class T>
void weight_grad(const Config& c, int64_t N, T* dW, const std::vector<T>& X, int64_t ldx, const std::vector<T>& dY,
                 int64_t ldy, int rows, int cols, bool fp32 = false) {
  const int64_t leaf = (int64_t)c.leaf_samples * c.seq_len;
  const bool bf16 = c.bf16 && !fp32;
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j)
      dW[(int64_t)i * cols + j] = token_product_reduce<T>(bf16, N, leaf, [&](int64_t n, T* x, T* y) {
        *x = X[n * ldx + i], *y = dY[n * ldy + j];
        return true;
      });
}

// Norm weight gradient: dw_i = sum over tokens of dout_i * xhat_i (reduces over the token index).
template <class T>
void norm_grad(const Config& c, int64_t N, T* dw, const std::vector<T>& x, const std::vector<T>& r,
               const std::vector<T>& dout) {
  const int D = c.d_model;
  const int64_t leaf = (int64_t)c.leaf_samples * c.seq_len;
  for (int i = 0; i < D; ++i)
    dw[i] = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return FMA(dout[n * D + i], x[n * D + i] * r[n], acc); });
}

// dh = dh + RMSNorm backward of dout at x.
template <class T>
void add_norm_backward(const Config& c, int64_t N, const std::vector<T>& x, const T* w, const std::vector<T>& r,
                       const std::vector<T>& dout, std::vector<T>& dh) {
  const int D = c.d_model;
  std::vector<T> dx(D);
  for (int64_t n = 0; n < N; ++n) {
    rmsnorm_backward(&x[n * D], w, r[n], &dout[n * D], dx.data(), D);
    for (int i = 0; i < D; ++i) dh[n * D + i] = dh[n * D + i] + dx[i];
  }
}

// Assignments per expert over the step's (token, slot) pairs.
template <class T>
int64_t count_of(const typename Step<T>::Layer& acts, int64_t NK, int e) {
  int64_t count = 0;
  for (int64_t i = 0; i < NK; ++i) count += acts.sel[i] == e;
  return count;
}

// Sample s's load-balancing loss E * sum_e f_se P_se: f_se its assignments
// to e over its T K, P_se the mean of its tokens' gates g_e (a sequential
// fold over the sample's tokens). Reduces over the expert index e.
template <class T>
T sample_balance(const typename Step<T>::Layer& acts, int64_t s, int64_t Ts, int E, int K) {
  T dot = 0;
  for (int e = 0; e < E; ++e) {
    int64_t count = 0;
    for (int64_t i = s * Ts * K; i < (s + 1) * Ts * K; ++i) count += acts.sel[i] == e;
    T P = 0;
    for (int64_t n = s * Ts; n < (s + 1) * Ts; ++n) P = P + acts.g[n * E + e];
    dot = FMA(T(count) / T(Ts * K), P / T(Ts), dot);
  }
  return T(E) * dot;
}

// ---------------------------------------------------------------- embedding
// h = tok_emb[x] + pos_emb[t].
template <class T>
void embedding_forward(Model<T>& m, Step<T>& st, int, Losses<T>&) {
  const Config& c = m.cfg;
  const int S = c.seq_len, D = c.d_model;
  const T *te = m.param("tok_emb").w.data(), *pe = m.param("pos_emb").w.data();
  std::vector<T>& h = c.n_layers > 0 ? st.layers[0].x : st.h;
  h.resize(st.N * D);
  for (int64_t n = 0; n < st.N; ++n)
    for (int i = 0; i < D; ++i) h[n * D + i] = te[(int64_t)st.tok_id[n] * D + i] + pe[(n % S) * D + i];
}

// Token reductions of dh over the tokens with that byte (tok_emb) or that
// position (pos_emb); the fold is a plain add.
template <class T>
void embedding_backward(Model<T>& m, Step<T>& st, int) {
  const Config& c = m.cfg;
  const int S = c.seq_len, D = c.d_model, V = c.vocab;
  const int64_t N = st.N, leaf = (int64_t)c.leaf_samples * S;
  const std::vector<T>& dh = st.dh;
  T *dte = m.param("tok_emb").g.data(), *dpe = m.param("pos_emb").g.data();
  for (int v = 0; v < V; ++v)
    for (int i = 0; i < D; ++i)
      dte[(int64_t)v * D + i] =
          token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return st.tok_id[n] == v ? acc + dh[n * D + i] : acc; });
  for (int t = 0; t < S; ++t)
    for (int i = 0; i < D; ++i)
      dpe[(int64_t)t * D + i] =
          token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return n % S == t ? acc + dh[n * D + i] : acc; });
}

// ---------------------------------------------------------------- attention
template <class T>
struct AttentionShape {
  AttentionShape(const Config& c, int batch)
      : S(c.seq_len), D(c.d_model), H(c.n_heads), hd(c.d_model / c.n_heads), B(batch), scale(T(1) / SQRT(T(hd))) {}
  int S, D, H, hd, B;
  T scale;  // 1 / sqrt(head dim)
};

template <class T>
void attention_forward(Model<T>& m, Step<T>& st, int l, Losses<T>&) {
  const Config& c = m.cfg;
  const AttentionShape<T> sh(c, st.batch);
  const int S = sh.S, D = sh.D, H = sh.H, hd = sh.hd, B = sh.B;
  const int64_t N = st.N;
  const T scale = sh.scale;
  typename Step<T>::Layer& acts = st.layers[l];
  const T *attn_norm = layer_param(m, l, "attn_norm").w.data(), *wqkv = layer_param(m, l, "wqkv").w.data(),
          *wo = layer_param(m, l, "wo").w.data();
  acts.a.resize(N * D);
  acts.r1.resize(N);
  for (int64_t n = 0; n < N; ++n) acts.r1[n] = rmsnorm(&acts.x[n * D], attn_norm, &acts.a[n * D], D, T(c.rms_eps));
  trace(m, st, "fwd", l, "attn_norm", "out", acts.a, {N, D});
  acts.qkv.resize(N * 3 * D);
  for (int64_t n = 0; n < N; ++n)
    for (int j = 0; j < 3 * D; ++j) acts.qkv[n * 3 * D + j] = dot_col(c.bf16, &acts.a[n * D], wqkv, 3 * D, j, D);
  trace(m, st, "fwd", l, "qkv", "out", acts.qkv, {N, 3 * D});
  acts.att.assign((size_t)B * H * S * S, T(0));
  acts.o.resize(N * D);
  for (int b = 0; b < B; ++b)
    for (int head = 0; head < H; ++head) {
      const T* base = &acts.qkv[(int64_t)b * S * 3 * D + head * hd];
      attention_head(base, base + D, base + 2 * D, 3 * D, S, hd, scale, &acts.att[((int64_t)b * H + head) * S * S],
                     &acts.o[(int64_t)b * S * D + head * hd], D, c.bf16);
    }
  trace(m, st, "fwd", l, "attention", "out", acts.o, {N, D});
  acts.xm.resize(N * D);
  for (int64_t n = 0; n < N; ++n)
    for (int j = 0; j < D; ++j) acts.xm[n * D + j] = acts.x[n * D + j] + dot_col(c.bf16, &acts.o[n * D], wo, D, j, D);
  trace(m, st, "fwd", l, "attn_residual", "h", acts.xm, {N, D});
}

template <class T>
void attention_backward(Model<T>& m, Step<T>& st, int l) {
  const Config& c = m.cfg;
  const AttentionShape<T> sh(c, st.batch);
  const int S = sh.S, D = sh.D, H = sh.H, hd = sh.hd, B = sh.B;
  const int64_t N = st.N;
  const T scale = sh.scale;
  typename Step<T>::Layer& acts = st.layers[l];
  const T *attn_norm = layer_param(m, l, "attn_norm").w.data(), *wqkv = layer_param(m, l, "wqkv").w.data(),
          *wo = layer_param(m, l, "wo").w.data();
  std::vector<T>& dh = st.dh;
  weight_grad(c, N, layer_param(m, l, "wo").g.data(), acts.o, D, dh, D, D, D);
  std::vector<T> dO(N * D), dqkv(N * 3 * D, T(0));
  for (int64_t n = 0; n < N; ++n)
    for (int i = 0; i < D; ++i) {
      dO[n * D + i] = product_fold(c.bf16, &dh[n * D], 1, wo + (int64_t)i * D, 1, D);  // over the output feature j
    }
  for (int b = 0; b < B; ++b)
    for (int head = 0; head < H; ++head) {
      const T* base = &acts.qkv[(int64_t)b * S * 3 * D + head * hd];
      T* dbase = &dqkv[(int64_t)b * S * 3 * D + head * hd];
      attention_head_backward(base, base + D, base + 2 * D, 3 * D, S, hd, scale,
                              &acts.att[((int64_t)b * H + head) * S * S], &dO[(int64_t)b * S * D + head * hd], D, dbase,
                              dbase + D, dbase + 2 * D, 3 * D);
    }
  trace(m, st, "bwd", l, "attention", "dqkv", dqkv, {N, 3 * D});
  weight_grad(c, N, layer_param(m, l, "wqkv").g.data(), acts.a, D, dqkv, 3 * D, D, 3 * D);
  std::vector<T> da(N * D);
  for (int64_t n = 0; n < N; ++n)
    for (int i = 0; i < D; ++i) {
      da[n * D + i] = product_fold(c.bf16, &dqkv[n * 3 * D], 1, wqkv + (int64_t)i * 3 * D, 1, 3 * D);  // over qkv feature j
    }
  norm_grad(c, N, layer_param(m, l, "attn_norm").g.data(), acts.x, acts.r1, da);
  add_norm_backward(c, N, acts.x, attn_norm, acts.r1, da, dh);
  trace(m, st, "bwd", l, "attn_norm", "dh", dh, {N, D});
}

// -------------------------------------------------------------- moe_routing
template <class T>
void moe_routing_forward(Model<T>& m, Step<T>& st, int l, Losses<T>&) {
  const Config& c = m.cfg;
  const int D = c.d_model, E = c.experts, K = c.top_k;
  const int64_t N = st.N;
  typename Step<T>::Layer& acts = st.layers[l];
  const T *moe_norm = layer_param(m, l, "moe_norm").w.data(), *router = layer_param(m, l, "router").w.data();
  acts.a2.resize(N * D);
  acts.r2.resize(N);
  for (int64_t n = 0; n < N; ++n) acts.r2[n] = rmsnorm(&acts.xm[n * D], moe_norm, &acts.a2[n * D], D, T(c.rms_eps));
  trace(m, st, "fwd", l, "moe_norm", "out", acts.a2, {N, D});
  acts.z.resize(N * E);
  acts.g.resize(N * E);
  acts.lse.resize(N);
  acts.sel.resize(N * K);
  for (int64_t n = 0; n < N; ++n) {
    for (int e = 0; e < E; ++e) acts.z[n * E + e] = dot_col(false, &acts.a2[n * D], router, E, e, D);
    // A fixed preference for the first max(1, E/4) experts (skewed routing).
    if (c.router_skew != 0)
      for (int e = 0; e < std::max(1, E / 4); ++e) acts.z[n * E + e] = acts.z[n * E + e] + T(c.router_skew);
    acts.lse[n] = softmax(&acts.z[n * E], &acts.g[n * E], E);
    // Top-k by gate probability; ties go to the lowest expert index.
    std::vector<bool> taken(E, false);
    for (int s = 0; s < K; ++s) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || acts.g[n * E + e] > acts.g[n * E + best])) best = e;
      taken[best] = true;
      acts.sel[n * K + s] = best;
    }
  }
  trace(m, st, "fwd", l, "router", "logits", acts.z, {N, E});
  trace(m, st, "fwd", l, "router", "gates", acts.g, {N, E});
}

// Router: dg from the combine, plus the aux-loss term (counts are
// constants), through the softmax, plus the z-loss term; then the norm.
template <class T>
void moe_routing_backward(Model<T>& m, Step<T>& st, int l) {
  const Config& c = m.cfg;
  const int D = c.d_model, E = c.experts, K = c.top_k;
  const int64_t N = st.N;
  typename Step<T>::Layer& acts = st.layers[l];
  const T *moe_norm = layer_param(m, l, "moe_norm").w.data(), *router = layer_param(m, l, "router").w.data();
  std::vector<T> auxc(E), dz(N * E);
  auto aux_constants = [&](int64_t first, int64_t tokens) {  // f_e over those tokens' assignments
    for (int e = 0; e < E; ++e) {
      int64_t count = 0;
      for (int64_t i = first * K; i < (first + tokens) * K; ++i) count += acts.sel[i] == e;
      T f = T(count) / T(tokens * K);
      auxc[e] = ((T(c.aux_loss_weight) * T(E)) * f) / T(N);
    }
  };
  if (!c.aux_per_sample) aux_constants(0, N);  // the step's counts; per sample, each sample's
  for (int64_t n = 0; n < N; ++n) {
    if (c.aux_per_sample && n % c.seq_len == 0) aux_constants(n, c.seq_len);
    for (int e = 0; e < E; ++e) st.dg[n * E + e] = st.dg[n * E + e] + auxc[e];
    softmax_backward(&acts.g[n * E], &st.dg[n * E], &dz[n * E], E);
    T zc = ((T(c.z_loss_weight) * T(2)) * acts.lse[n]) / T(N);
    for (int e = 0; e < E; ++e) dz[n * E + e] = dz[n * E + e] + zc * acts.g[n * E + e];
  }
  trace(m, st, "bwd", l, "router", "dz", dz, {N, E});
  weight_grad(c, N, layer_param(m, l, "router").g.data(), acts.a2, D, dz, E, D, E, true);  // the router: fp32
  std::vector<T>& da2 = st.da2;
  for (int64_t n = 0; n < N; ++n)
    for (int i = 0; i < D; ++i) {
      T acc = 0;  // reduces over the expert index e
      for (int e = 0; e < E; ++e) acc = FMA(dz[n * E + e], router[(int64_t)i * E + e], acc);
      da2[n * D + i] = da2[n * D + i] + acc;
    }
  norm_grad(c, N, layer_param(m, l, "moe_norm").g.data(), acts.xm, acts.r2, da2);
  add_norm_backward(c, N, acts.xm, moe_norm, acts.r2, da2, st.dh);
  trace(m, st, "bwd", l, "moe_norm", "dh", st.dh, {N, D});
}

// ------------------------------------------------------------- moe_dispatch
// Slot (n, s)'s row is token n's normed input.
template <class T>
void moe_dispatch_forward(Model<T>& m, Step<T>& st, int l, Losses<T>&) {
  const int D = m.cfg.d_model, K = m.cfg.top_k;
  typename Step<T>::Layer& acts = st.layers[l];
  acts.xe.resize(st.N * K * D);
  for (int64_t n = 0; n < st.N; ++n)
    for (int s = 0; s < K; ++s) std::copy(&acts.a2[n * D], &acts.a2[n * D] + D, &acts.xe[(n * K + s) * D]);
}

// da2 = (sum over slots, in slot order, from +0) + the shared expert's
// input gradient; the routing adds the router's.
template <class T>
void moe_dispatch_backward(Model<T>& m, Step<T>& st, int) {
  const int D = m.cfg.d_model, K = m.cfg.top_k;
  const int64_t N = st.N;
  st.da2.assign(N * D, T(0));
  for (int64_t n = 0; n < N; ++n)
    for (int s = 0; s < K; ++s)
      for (int i = 0; i < D; ++i) st.da2[n * D + i] = st.da2[n * D + i] + st.dxe[(n * K + s) * D + i];
  if (m.cfg.shared_expert)
    for (int64_t n = 0; n < N * D; ++n) st.da2[n] = st.da2[n] + st.shared_dx[n];
}

// -------------------------------------------------------------- moe_experts
template <class T>
void moe_experts_forward(Model<T>& m, Step<T>& st, int l, Losses<T>&) {
  const Config& c = m.cfg;
  const int D = c.d_model, F = c.d_ff, K = c.top_k;
  const int64_t N = st.N;
  typename Step<T>::Layer& acts = st.layers[l];
  Param<T>&W1 = layer_param(m, l, "experts.w1"), &W3 = layer_param(m, l, "experts.w3"),
  &W2 = layer_param(m, l, "experts.w2");
  acts.u.resize(N * K * F);
  acts.v.resize(N * K * F);
  acts.act.resize(N * K * F);
  acts.ye.resize(N * K * D);
  for (int64_t ns = 0; ns < N * K; ++ns) {
    const int e = acts.sel[ns];
    expert_forward(c.bf16, &acts.xe[ns * D], &W1.w[(int64_t)e * D * F], &W3.w[(int64_t)e * D * F], &W2.w[(int64_t)e * F * D], D,
                   F, &acts.u[ns * F], &acts.v[ns * F], &acts.act[ns * F], &acts.ye[ns * D]);
  }
  trace(m, st, "fwd", l, "moe.experts", "out", acts.ye, {N, K, D});
}

// dye -> dxe per (token, slot); the expert weight gradients are token
// reductions over the tokens routed to each expert.
template <class T>
void moe_experts_backward(Model<T>& m, Step<T>& st, int l) {
  const Config& c = m.cfg;
  const int D = c.d_model, F = c.d_ff, K = c.top_k, E = c.experts;
  const int64_t N = st.N, leaf = (int64_t)c.leaf_samples * c.seq_len;
  typename Step<T>::Layer& acts = st.layers[l];
  Param<T>&W1 = layer_param(m, l, "experts.w1"), &W3 = layer_param(m, l, "experts.w3"),
  &W2 = layer_param(m, l, "experts.w2");
  std::vector<T> du(N * K * F), dv(N * K * F);
  st.dxe.resize(N * K * D);
  for (int64_t ns = 0; ns < N * K; ++ns) {
    const int e = acts.sel[ns];
    expert_backward(c.bf16, &acts.u[ns * F], &acts.v[ns * F], &W1.w[(int64_t)e * D * F], &W3.w[(int64_t)e * D * F],
                    &W2.w[(int64_t)e * F * D], &st.dye[ns * D], D, F, &du[ns * F], &dv[ns * F], &st.dxe[ns * D]);
  }
  trace(m, st, "bwd", l, "moe.experts", "dx", st.dxe, {N, K, D});
  for (int e = 0; e < E; ++e) {
    auto slot_of = [&](int64_t n) {
      for (int s = 0; s < K; ++s)
        if (acts.sel[n * K + s] == e) return s;
      return -1;
    };
    // Over the tokens routed to e: X[ns][i] = x(ns, i) and dY[ns][j] = y(ns, j), ns its (token, slot) row.
    auto reduce_routed = [&](const std::vector<T>& X, int64_t ldx, int64_t i, const std::vector<T>& dY, int64_t ldy,
                             int64_t j) {
      return token_product_reduce<T>(c.bf16, N, leaf, [&](int64_t n, T* x, T* y) {
        const int s = slot_of(n);
        if (s < 0) return false;
        *x = X[(n * K + s) * ldx + i], *y = dY[(n * K + s) * ldy + j];
        return true;
      });
    };
    for (int i = 0; i < D; ++i)
      for (int f = 0; f < F; ++f) {
        W1.g[((int64_t)e * D + i) * F + f] = reduce_routed(acts.xe, D, i, du, F, f);
        W3.g[((int64_t)e * D + i) * F + f] = reduce_routed(acts.xe, D, i, dv, F, f);
      }
    for (int f = 0; f < F; ++f)
      for (int j = 0; j < D; ++j)
        W2.g[((int64_t)e * F + f) * D + j] = reduce_routed(acts.act, F, f, st.dye, D, j);
  }
}

// -------------------------------------------------------------- moe_combine
template <class T>
void moe_combine_forward(Model<T>& m, Step<T>& st, int l, Losses<T>& losses) {
  const Config& c = m.cfg;
  const int D = c.d_model, F = c.d_ff, E = c.experts, K = c.top_k;
  const int64_t N = st.N, leaf = (int64_t)c.leaf_samples * c.seq_len;
  typename Step<T>::Layer& acts = st.layers[l];
  if (c.shared_expert) {
    acts.shared_u.resize(N * F);
    acts.shared_v.resize(N * F);
    acts.shared_act.resize(N * F);
    acts.shared_out.resize(N * D);
    const T *s1 = layer_param(m, l, "shared.w1").w.data(), *s3 = layer_param(m, l, "shared.w3").w.data(),
            *s2 = layer_param(m, l, "shared.w2").w.data();
    for (int64_t n = 0; n < N; ++n)
      expert_forward(c.bf16, &acts.a2[n * D], s1, s3, s2, D, F, &acts.shared_u[n * F], &acts.shared_v[n * F], &acts.shared_act[n * F], &acts.shared_out[n * D]);
  }
  // out = fold over slots of fma(gate, y_slot, out) from +0, then + shared; h = residual + out.
  std::vector<T>& h = layer_output(st, l);
  h.resize(N * D);
  for (int64_t n = 0; n < N; ++n)
    for (int j = 0; j < D; ++j) {
      T out = 0;
      for (int s = 0; s < K; ++s) out = FMA(acts.g[n * E + acts.sel[n * K + s]], acts.ye[(n * K + s) * D + j], out);
      if (c.shared_expert) out = out + acts.shared_out[n * D + j];
      h[n * D + j] = acts.xm[n * D + j] + out;
    }
  trace(m, st, "fwd", l, "moe.combine", "h", h, {N, D});
  // Switch load balancing: aux = E * sum_e f_e * P_e, f_e = count_e / (N K),
  // P_e = mean over tokens of g_e (a token reduction).
  // Per sample (moe.aux_scope=sequence): each sample's loss, averaged over the samples (a token reduction whose
  // items are samples: in order inside a leaf of leaf_samples, leaves by the canonical tree).
  if (c.aux_per_sample) {
    const int64_t B = N / c.seq_len;
    acts.aux = token_reduce<T>(B, c.leaf_samples, [&](int64_t s, T acc) {
                 return acc + sample_balance<T>(acts, s, c.seq_len, E, K);
               }) / T(B);
  } else {
    T dot = 0;  // reduces over the expert index e
    for (int e = 0; e < E; ++e) {
      T f = T(count_of<T>(acts, N * K, e)) / T(N * K);
      T Pe = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return acc + acts.g[n * E + e]; }) / T(N);
      dot = FMA(f, Pe, dot);
    }
    acts.aux = T(E) * dot;
  }
  // z-loss: mean over tokens of lse^2 (a token reduction).
  acts.zl = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return FMA(acts.lse[n], acts.lse[n], acc); }) / T(N);
  losses.aux = losses.aux + acts.aux;  // the step's sums fold layer by layer
  losses.z = losses.z + acts.zl;
}

// dh (the layer output's gradient) -> dg and dye; the shared expert's
// gradients. The residual's gradient stays in dh.
template <class T>
void moe_combine_backward(Model<T>& m, Step<T>& st, int l) {
  const Config& c = m.cfg;
  const int D = c.d_model, F = c.d_ff, E = c.experts, K = c.top_k;
  const int64_t N = st.N;
  typename Step<T>::Layer& acts = st.layers[l];
  const std::vector<T>& dh = st.dh;
  st.dg.assign(N * E, T(0));
  st.dye.resize(N * K * D);
  for (int64_t n = 0; n < N; ++n)
    for (int s = 0; s < K; ++s) {
      const int e = acts.sel[n * K + s];
      const int64_t ns = n * K + s;
      const T gate = acts.g[n * E + e];
      T dgate = 0;  // reduces over the model feature j
      for (int j = 0; j < D; ++j) dgate = FMA(dh[n * D + j], acts.ye[ns * D + j], dgate);
      st.dg[n * E + e] = dgate;
      for (int j = 0; j < D; ++j) st.dye[ns * D + j] = gate * dh[n * D + j];
    }
  if (!c.shared_expert) return;
  std::vector<T> shared_du(N * F), shared_dv(N * F);
  st.shared_dx.resize(N * D);
  for (int64_t n = 0; n < N; ++n)
    expert_backward(c.bf16, &acts.shared_u[n * F], &acts.shared_v[n * F], layer_param(m, l, "shared.w1").w.data(),
                    layer_param(m, l, "shared.w3").w.data(), layer_param(m, l, "shared.w2").w.data(), &dh[n * D], D, F,
                    &shared_du[n * F], &shared_dv[n * F], &st.shared_dx[n * D]);
  weight_grad(c, N, layer_param(m, l, "shared.w1").g.data(), acts.a2, D, shared_du, F, D, F);
  weight_grad(c, N, layer_param(m, l, "shared.w3").g.data(), acts.a2, D, shared_dv, F, D, F);
  weight_grad(c, N, layer_param(m, l, "shared.w2").g.data(), acts.shared_act, F, dh, D, F, D);
}

// --------------------------------------------------------------------- head
template <class T>
void head_forward(Model<T>& m, Step<T>& st, int, Losses<T>& losses) {
  const Config& c = m.cfg;
  const int S = c.seq_len, D = c.d_model, V = c.vocab;
  const int64_t N = st.N, leaf = (int64_t)c.leaf_samples * S;
  const T *final_norm = m.param("final_norm").w.data(), *lm_head = m.param("lm_head").w.data();
  st.af.resize(N * D);
  st.rf.resize(N);
  st.logits.resize(N * V);
  st.prob.resize(N * V);
  st.loss.resize(N);
  for (int64_t n = 0; n < N; ++n) st.rf[n] = rmsnorm(&st.h[n * D], final_norm, &st.af[n * D], D, T(c.rms_eps));
  trace(m, st, "fwd", -1, "final_norm", "out", st.af, {N, D});
  for (int64_t n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v) st.logits[n * V + v] = dot_col(c.bf16, &st.af[n * D], lm_head, V, v, D);
  trace(m, st, "fwd", -1, "lm_head", "logits", st.logits, {N, V});
  for (int64_t n = 0; n < N; ++n) {
    const T lse = softmax(&st.logits[n * V], &st.prob[n * V], V);
    st.loss[n] = lse - st.logits[n * V + st.target_id[n]];
  }
  trace(m, st, "fwd", -1, "loss", "per_token", st.loss, {N});
  // Mean loss: a token reduction of the per-token loss lse - logit[target].
  losses.ce = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return acc + st.loss[n]; }) / T(N);
  losses.total = losses.ce + T(c.aux_loss_weight) * losses.aux + T(c.z_loss_weight) * losses.z;
}

template <class T>
void head_backward(Model<T>& m, Step<T>& st, int) {
  const Config& c = m.cfg;
  const int D = c.d_model, V = c.vocab;
  const int64_t N = st.N;
  const T *final_norm = m.param("final_norm").w.data(), *lm_head = m.param("lm_head").w.data();
  std::vector<T> dlogits(N * V);
  for (int64_t n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v)
      dlogits[n * V + v] = (st.prob[n * V + v] - (v == st.target_id[n] ? T(1) : T(0))) / T(N);
  trace(m, st, "bwd", -1, "lm_head", "dlogits", dlogits, {N, V});
  weight_grad(c, N, m.param("lm_head").g.data(), st.af, D, dlogits, V, D, V);
  std::vector<T> daf(N * D);
  // daf[n][i] = sum_v dlogits[n][v] * lm_head[i][v]: reduces over the vocab index v.
  for (int64_t n = 0; n < N; ++n)
    for (int i = 0; i < D; ++i) daf[n * D + i] = product_fold(c.bf16, &dlogits[n * V], 1, lm_head + (int64_t)i * V, 1, V);
  norm_grad(c, N, m.param("final_norm").g.data(), st.h, st.rf, daf);
  st.dh.assign(N * D, T(0));
  for (int64_t n = 0; n < N; ++n) rmsnorm_backward(&st.h[n * D], final_norm, st.rf[n], &daf[n * D], &st.dh[n * D], D);
  trace(m, st, "bwd", -1, "final_norm", "dh", st.dh, {N, D});
}

}  // namespace

template <class T>
std::vector<BlockDef<T>> make_blocks(const Config& c) {
  std::vector<BlockDef<T>> blocks;
  blocks.push_back({"embedding", -1, false, embedding_forward<T>, embedding_backward<T>});
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    blocks.push_back({p + "attention", l, true, attention_forward<T>, attention_backward<T>});
    blocks.push_back({p + "moe_routing", l, true, moe_routing_forward<T>, moe_routing_backward<T>});
    blocks.push_back({p + "moe_dispatch", l, false, moe_dispatch_forward<T>, moe_dispatch_backward<T>});
    blocks.push_back({p + "moe_experts", l, false, moe_experts_forward<T>, moe_experts_backward<T>});
    blocks.push_back({p + "moe_combine", l, false, moe_combine_forward<T>, moe_combine_backward<T>});
  }
  blocks.push_back({"head", -1, true, head_forward<T>, head_backward<T>});
  return blocks;
}

template <class T>
std::vector<T>& stream_before(Step<T>& st, const BlockDef<T>& b) {
  if (b.name == "head") return st.h;
  if (b.name.size() > 10 && b.name.compare(b.name.size() - 10, 10, ".attention") == 0) return st.layers[b.layer].x;
  return st.layers[b.layer].xm;  // moe_routing
}

template std::vector<BlockDef<float>> make_blocks<float>(const Config&);
template std::vector<BlockDef<double>> make_blocks<double>(const Config&);
template std::vector<float>& stream_before<float>(Step<float>&, const BlockDef<float>&);
template std::vector<double>& stream_before<double>(Step<double>&, const BlockDef<double>&);

}  // namespace ref
