// The reference model: every equation as a plain loop, in the order the
// numerics contract fixes. Comments at each reduction name its index.
#include "reference.h"

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "contract.h"

namespace ref {

std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes(const Config& c) {
  const int64_t V = c.vocab, D = c.d_model, F = c.d_ff, E = c.experts, T = c.seq_len;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  out.push_back({"tok_emb", {V, D}});
  out.push_back({"pos_emb", {T, D}});
  out.push_back({"final_norm", {D}});
  out.push_back({"lm_head", {D, V}});
  for (int l = 0; l < c.n_layers; ++l) {
    std::string p = "layers." + std::to_string(l) + ".";
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
  std::sort(out.begin(), out.end());
  return out;
}

template <class T>
Model<T>::Model(const Config& c, uint64_t seed) : cfg(c) {
  for (auto& [name, shape] : param_shapes(c)) {
    Param<T> p;
    p.name = name;
    p.shape = shape;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bool is_norm = shape.size() == 1;
    p.decay = !is_norm;
    p.w.resize(n);
    p.g.assign(n, T(0));
    p.m.assign(n, T(0));
    p.v.assign(n, T(0));
    const uint32_t id = ls::tensor_id(name.c_str());
    for (int64_t i = 0; i < n; ++i) p.w[i] = is_norm ? T(1) : T(ls::init_uniform(seed, id, (uint64_t)i, c.init_std));
    params.push_back(std::move(p));
  }
}

template <class T>
Param<T>& Model<T>::param(const std::string& name) {
  for (auto& p : params)
    if (p.name == name) return p;
  throw std::out_of_range("reference: no parameter '" + name + "'");
}

template <class T>
Losses<T> Model<T>::forward(const uint8_t* tokens, int batch) {
  return run(tokens, batch, false);
}
template <class T>
Losses<T> Model<T>::forward_backward(const uint8_t* tokens, int batch) {
  return run(tokens, batch, true);
}


template <class T>
Losses<T> Model<T>::run(const uint8_t* tokens, int B, bool backward) {
  const Config& c = cfg;
  const int S = c.seq_len, D = c.d_model, H = c.n_heads, hd = D / H, E = c.experts, K = c.top_k,
            F = c.d_ff, V = c.vocab, L = c.n_layers;
  const int64_t N = (int64_t)B * S;
  const int64_t leaf = (int64_t)c.leaf_samples * S;  // tokens per leaf
  const T eps = T(c.rms_eps);
  const T scale = T(1) / SQRT(T(hd));
  auto tok = [&](int64_t n) { return (int)tokens[(n / S) * (S + 1) + n % S]; };
  auto target = [&](int64_t n) { return (int)tokens[(n / S) * (S + 1) + n % S + 1]; };
  auto P = [&](const std::string& s) -> Param<T>& { return param(s); };
  auto LP = [&](int l, const char* s) -> Param<T>& { return param("layers." + std::to_string(l) + "." + s); };

  auto TR = [&](const char* phase, int layer, const char* op, const char* name, const std::vector<T>& data,
                std::vector<int64_t> shape) {
    if constexpr (sizeof(T) == sizeof(float))
      if (backward && trace) trace(phase, layer, op, name, data.data(), shape);
  };
  for (auto& p : params) TR("params", -1, "param", p.name.c_str(), p.w, p.shape);
  // Saved activations, per layer.
  struct Layer {
    std::vector<T> x, a, r1, qkv, att, o, xm, a2, r2, z, g, lse, u, v, act, ye, su, sv, sact, ysh;
    std::vector<int> sel;
  };
  std::vector<Layer> acts(L);

  // Embedding: h = tok_emb[x] + pos_emb[t].
  std::vector<T> h((size_t)N * D);
  {
    const T *te = P("tok_emb").w.data(), *pe = P("pos_emb").w.data();
    for (int64_t n = 0; n < N; ++n)
      for (int i = 0; i < D; ++i) h[n * D + i] = te[(int64_t)tok(n) * D + i] + pe[(n % S) * D + i];
  }

  std::vector<T> aux_l(L, T(0)), z_l(L, T(0));
  for (int l = 0; l < L; ++l) {
    Layer& A = acts[l];
    const T *attn_norm = LP(l, "attn_norm").w.data(), *wqkv = LP(l, "wqkv").w.data(), *wo = LP(l, "wo").w.data(),
            *moe_norm = LP(l, "moe_norm").w.data(), *router = LP(l, "router").w.data();
    A.x = h;
    // --- attention block
    A.a.resize(N * D);
    A.r1.resize(N);
    for (int64_t n = 0; n < N; ++n)
      A.r1[n] = rmsnorm(&h[n * D], attn_norm, &A.a[n * D], D, eps);
    TR("fwd", l, "attn_norm", "out", A.a, {N, D});
    A.qkv.resize(N * 3 * D);
    for (int64_t n = 0; n < N; ++n)
      for (int j = 0; j < 3 * D; ++j) A.qkv[n * 3 * D + j] = dot_col(&A.a[n * D], wqkv, 3 * D, j, D);
    TR("fwd", l, "qkv", "out", A.qkv, {N, 3 * D});
    A.att.assign((size_t)B * H * S * S, T(0));
    A.o.resize(N * D);
    for (int b = 0; b < B; ++b)
      for (int hh = 0; hh < H; ++hh) {
        const T* base = &A.qkv[(int64_t)b * S * 3 * D + hh * hd];
        attention_head(base, base + D, base + 2 * D, 3 * D, S, hd, scale, &A.att[((int64_t)b * H + hh) * S * S],
                       &A.o[(int64_t)b * S * D + hh * hd], D);
      }
    TR("fwd", l, "attention", "out", A.o, {N, D});
    for (int64_t n = 0; n < N; ++n)
      for (int j = 0; j < D; ++j) h[n * D + j] = h[n * D + j] + dot_col(&A.o[n * D], wo, D, j, D);
    A.xm = h;
    TR("fwd", l, "attn_residual", "h", A.xm, {N, D});
    // --- MoE block
    A.a2.resize(N * D);
    A.r2.resize(N);
    for (int64_t n = 0; n < N; ++n)
      A.r2[n] = rmsnorm(&h[n * D], moe_norm, &A.a2[n * D], D, eps);
    TR("fwd", l, "moe_norm", "out", A.a2, {N, D});
    A.z.resize(N * E);
    A.g.resize(N * E);
    A.lse.resize(N);
    A.sel.resize(N * K);
    for (int64_t n = 0; n < N; ++n) {
      for (int e = 0; e < E; ++e) A.z[n * E + e] = dot_col(&A.a2[n * D], router, E, e, D);
      // A fixed preference for the first max(1, E/4) experts (skewed routing).
      if (c.router_skew != 0)
        for (int e = 0; e < std::max(1, E / 4); ++e) A.z[n * E + e] = A.z[n * E + e] + T(c.router_skew);
      A.lse[n] = softmax(&A.z[n * E], &A.g[n * E], E);
      // Top-k by gate probability; ties go to the lowest expert index.
      std::vector<bool> taken(E, false);
      for (int s = 0; s < K; ++s) {
        int best = -1;
        for (int e = 0; e < E; ++e)
          if (!taken[e] && (best < 0 || A.g[n * E + e] > A.g[n * E + best])) best = e;
        taken[best] = true;
        A.sel[n * K + s] = best;
      }
    }
    TR("fwd", l, "router", "logits", A.z, {N, E});
    TR("fwd", l, "router", "gates", A.g, {N, E});
    A.u.resize(N * K * F);
    A.v.resize(N * K * F);
    A.act.resize(N * K * F);
    A.ye.resize(N * K * D);
    Param<T>&W1 = LP(l, "experts.w1"), &W3 = LP(l, "experts.w3"), &W2 = LP(l, "experts.w2");
    for (int64_t n = 0; n < N; ++n)
      for (int s = 0; s < K; ++s) {
        int e = A.sel[n * K + s];
        int64_t ns = n * K + s;
        expert_forward(&A.a2[n * D], &W1.w[(int64_t)e * D * F], &W3.w[(int64_t)e * D * F], &W2.w[(int64_t)e * F * D], D, F,
                       &A.u[ns * F], &A.v[ns * F], &A.act[ns * F], &A.ye[ns * D]);
      }
    TR("fwd", l, "moe.experts", "out", A.ye, {N, K, D});
    if (c.shared_expert) {
      A.su.resize(N * F);
      A.sv.resize(N * F);
      A.sact.resize(N * F);
      A.ysh.resize(N * D);
      const T *s1 = LP(l, "shared.w1").w.data(), *s3 = LP(l, "shared.w3").w.data(), *s2 = LP(l, "shared.w2").w.data();
      for (int64_t n = 0; n < N; ++n)
        expert_forward(&A.a2[n * D], s1, s3, s2, D, F, &A.su[n * F], &A.sv[n * F], &A.sact[n * F], &A.ysh[n * D]);
    }
    // Combine: out = fold over slots of fma(gate, y_slot, out) from +0, then + shared.
    for (int64_t n = 0; n < N; ++n)
      for (int j = 0; j < D; ++j) {
        T out = 0;
        for (int s = 0; s < K; ++s) out = FMA(A.g[n * E + A.sel[n * K + s]], A.ye[(n * K + s) * D + j], out);
        if (c.shared_expert) out = out + A.ysh[n * D + j];
        h[n * D + j] = h[n * D + j] + out;
      }
    TR("fwd", l, "moe.combine", "h", h, {N, D});
    // Switch load balancing: aux = E * sum_e f_e * P_e, f_e = count_e / (N K),
    // P_e = mean over tokens of g_e (a token reduction).
    T dot = 0;  // reduces over the expert index e
    for (int e = 0; e < E; ++e) {
      int64_t count = 0;
      for (int64_t i = 0; i < N * K; ++i) count += A.sel[i] == e;
      T f = T(count) / T(N * K);
      T Pe = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return acc + A.g[n * E + e]; }) / T(N);
      dot = FMA(f, Pe, dot);
    }
    aux_l[l] = T(E) * dot;
    // z-loss: mean over tokens of lse^2 (a token reduction).
    z_l[l] = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return FMA(A.lse[n], A.lse[n], acc); }) / T(N);
  }

  // Final norm, head, cross-entropy.
  std::vector<T> af(N * D), rf(N), logits(N * V), lse(N);
  const T *final_norm = P("final_norm").w.data(), *lm_head = P("lm_head").w.data();
  for (int64_t n = 0; n < N; ++n) rf[n] = rmsnorm(&h[n * D], final_norm, &af[n * D], D, eps);
  TR("fwd", -1, "final_norm", "out", af, {N, D});
  std::vector<T> prob(N * V), loss(N);
  for (int64_t n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v) logits[n * V + v] = dot_col(&af[n * D], lm_head, V, v, D);
  TR("fwd", -1, "lm_head", "logits", logits, {N, V});
  for (int64_t n = 0; n < N; ++n) {
    lse[n] = softmax(&logits[n * V], &prob[n * V], V);
    loss[n] = lse[n] - logits[n * V + target(n)];
  }
  TR("fwd", -1, "loss", "per_token", loss, {N});
  Losses<T> out;
  // Mean loss: a token reduction of the per-token loss lse - logit[target].
  out.ce = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return acc + loss[n]; }) / T(N);
  for (int l = 0; l < L; ++l) out.aux = out.aux + aux_l[l];
  for (int l = 0; l < L; ++l) out.z = out.z + z_l[l];
  out.total = out.ce + T(c.aux_loss_weight) * out.aux + T(c.z_loss_weight) * out.z;
  if (!backward) return out;

  // ------------------------------------------------------------ backward --
  for (auto& p : params) std::fill(p.g.begin(), p.g.end(), T(0));
  // Weight gradient: dW[i][j] = sum over tokens of X[n][i] * dY[n][j]
  // (reduces over the global token index: fma fold per leaf, canonical tree).
  auto weight_grad = [&](T* dW, const std::vector<T>& X, int64_t ldx, const std::vector<T>& dY, int64_t ldy, int rows, int cols) {
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j)
        dW[(int64_t)i * cols + j] = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return FMA(X[n * ldx + i], dY[n * ldy + j], acc); });
  };

  std::vector<T> dlogits(N * V);
  for (int64_t n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v)
      dlogits[n * V + v] = (prob[n * V + v] - (v == target(n) ? T(1) : T(0))) / T(N);
  TR("bwd", -1, "lm_head", "dlogits", dlogits, {N, V});
  weight_grad(P("lm_head").g.data(), af, D, dlogits, V, D, V);
  std::vector<T> dh(N * D), tmp(N * D), dx(D);
  // daf[n][i] = sum_v dlogits[n][v] * lm_head[i][v]: reduces over the vocab index v.
  for (int64_t n = 0; n < N; ++n)
    for (int i = 0; i < D; ++i) {
      T acc = 0;
      for (int v = 0; v < V; ++v) acc = FMA(dlogits[n * V + v], lm_head[(int64_t)i * V + v], acc);
      tmp[n * D + i] = acc;
    }
  // Norm weight gradient: dw_i = sum over tokens of dout_i * xhat_i (token reduction).
  auto norm_grad = [&](T* dw, const std::vector<T>& x, const std::vector<T>& r, const std::vector<T>& dout) {
    for (int i = 0; i < D; ++i)
      dw[i] = token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return FMA(dout[n * D + i], x[n * D + i] * r[n], acc); });
  };
  norm_grad(P("final_norm").g.data(), h, rf, tmp);
  for (int64_t n = 0; n < N; ++n) rmsnorm_backward(&h[n * D], final_norm, rf[n], &tmp[n * D], &dh[n * D], D);
  TR("bwd", -1, "final_norm", "dh", dh, {N, D});

  for (int l = L - 1; l >= 0; --l) {
    Layer& A = acts[l];
    const T *attn_norm = LP(l, "attn_norm").w.data(), *wqkv = LP(l, "wqkv").w.data(), *wo = LP(l, "wo").w.data(),
            *moe_norm = LP(l, "moe_norm").w.data(), *router = LP(l, "router").w.data();
    // --- MoE block backward. dh is the gradient of the block output.
    Param<T>&W1 = LP(l, "experts.w1"), &W3 = LP(l, "experts.w3"), &W2 = LP(l, "experts.w2");
    std::vector<T> du(N * K * F), dv(N * K * F), dye(N * K * D), dxe(N * K * D), dg(N * E, T(0));
    for (int64_t n = 0; n < N; ++n)
      for (int s = 0; s < K; ++s) {
        int e = A.sel[n * K + s];
        int64_t ns = n * K + s;
        T gate = A.g[n * E + e];
        T dgate = 0;  // reduces over the model feature j
        for (int j = 0; j < D; ++j) dgate = FMA(dh[n * D + j], A.ye[ns * D + j], dgate);
        dg[n * E + e] = dgate;
        for (int j = 0; j < D; ++j) dye[ns * D + j] = gate * dh[n * D + j];
        expert_backward(&A.u[ns * F], &A.v[ns * F], &W1.w[(int64_t)e * D * F], &W3.w[(int64_t)e * D * F],
                        &W2.w[(int64_t)e * F * D], &dye[ns * D], D, F, &du[ns * F], &dv[ns * F], &dxe[ns * D]);
      }
    TR("bwd", l, "moe.experts", "dx", dxe, {N, K, D});
    // Expert weight gradients: token reductions over the tokens routed to e.
    for (int e = 0; e < E; ++e) {
      auto slot_of = [&](int64_t n) {
        for (int s = 0; s < K; ++s)
          if (A.sel[n * K + s] == e) return s;
        return -1;
      };
      auto reduce_routed = [&](auto term) {
        return token_reduce<T>(N, leaf, [&](int64_t n, T acc) {
          int s = slot_of(n);
          return s < 0 ? acc : term(n * K + s, n, acc);
        });
      };
      for (int i = 0; i < D; ++i)
        for (int f = 0; f < F; ++f) {
          W1.g[((int64_t)e * D + i) * F + f] = reduce_routed([&](int64_t ns, int64_t n, T acc) { return FMA(A.a2[n * D + i], du[ns * F + f], acc); });
          W3.g[((int64_t)e * D + i) * F + f] = reduce_routed([&](int64_t ns, int64_t n, T acc) { return FMA(A.a2[n * D + i], dv[ns * F + f], acc); });
        }
      for (int f = 0; f < F; ++f)
        for (int j = 0; j < D; ++j)
          W2.g[((int64_t)e * F + f) * D + j] = reduce_routed([&](int64_t ns, int64_t, T acc) { return FMA(A.act[ns * F + f], dye[ns * D + j], acc); });
    }
    // da2 = (sum over slots, in slot order) + shared + router part.
    std::vector<T> da2(N * D, T(0));
    for (int64_t n = 0; n < N; ++n)
      for (int s = 0; s < K; ++s)
        for (int i = 0; i < D; ++i) da2[n * D + i] = da2[n * D + i] + dxe[(n * K + s) * D + i];
    if (c.shared_expert) {
      std::vector<T> sdu(N * F), sdv(N * F), sdx(N * D);
      for (int64_t n = 0; n < N; ++n)
        expert_backward(&A.su[n * F], &A.sv[n * F], LP(l, "shared.w1").w.data(), LP(l, "shared.w3").w.data(),
                        LP(l, "shared.w2").w.data(), &dh[n * D], D, F, &sdu[n * F], &sdv[n * F], &sdx[n * D]);
      weight_grad(LP(l, "shared.w1").g.data(), A.a2, D, sdu, F, D, F);
      weight_grad(LP(l, "shared.w3").g.data(), A.a2, D, sdv, F, D, F);
      weight_grad(LP(l, "shared.w2").g.data(), A.sact, F, dh, D, F, D);
      for (int64_t n = 0; n < N * D; ++n) da2[n] = da2[n] + sdx[n];
    }
    // Router: dg from the combine, plus the aux-loss term (counts are
    // constants), through the softmax, plus the z-loss term.
    std::vector<T> auxc(E), dz(N * E);
    for (int e = 0; e < E; ++e) {
      int64_t count = 0;
      for (int64_t i = 0; i < N * K; ++i) count += A.sel[i] == e;
      T f = T(count) / T(N * K);
      auxc[e] = ((T(c.aux_loss_weight) * T(E)) * f) / T(N);
    }
    for (int64_t n = 0; n < N; ++n) {
      for (int e = 0; e < E; ++e) dg[n * E + e] = dg[n * E + e] + auxc[e];
      softmax_backward(&A.g[n * E], &dg[n * E], &dz[n * E], E);
      T zc = ((T(c.z_loss_weight) * T(2)) * A.lse[n]) / T(N);
      for (int e = 0; e < E; ++e) dz[n * E + e] = dz[n * E + e] + zc * A.g[n * E + e];
    }
    TR("bwd", l, "router", "dz", dz, {N, E});
    weight_grad(LP(l, "router").g.data(), A.a2, D, dz, E, D, E);
    for (int64_t n = 0; n < N; ++n)
      for (int i = 0; i < D; ++i) {
        T acc = 0;  // reduces over the expert index e
        for (int e = 0; e < E; ++e) acc = FMA(dz[n * E + e], router[(int64_t)i * E + e], acc);
        da2[n * D + i] = da2[n * D + i] + acc;
      }
    norm_grad(LP(l, "moe_norm").g.data(), A.xm, A.r2, da2);
    for (int64_t n = 0; n < N; ++n) {
      rmsnorm_backward(&A.xm[n * D], moe_norm, A.r2[n], &da2[n * D], dx.data(), D);
      for (int i = 0; i < D; ++i) dh[n * D + i] = dh[n * D + i] + dx[i];
    }
    TR("bwd", l, "moe_norm", "dh", dh, {N, D});

    // --- attention block backward. dh is the gradient of the block output.
    weight_grad(LP(l, "wo").g.data(), A.o, D, dh, D, D, D);
    std::vector<T> dO(N * D), dqkv(N * 3 * D, T(0));
    for (int64_t n = 0; n < N; ++n)
      for (int i = 0; i < D; ++i) {
        T acc = 0;  // reduces over the output feature j
        for (int j = 0; j < D; ++j) acc = FMA(dh[n * D + j], wo[(int64_t)i * D + j], acc);
        dO[n * D + i] = acc;
      }
    for (int b = 0; b < B; ++b)
      for (int hh = 0; hh < H; ++hh) {
        const T* base = &A.qkv[(int64_t)b * S * 3 * D + hh * hd];
        T* dbase = &dqkv[(int64_t)b * S * 3 * D + hh * hd];
        attention_head_backward(base, base + D, base + 2 * D, 3 * D, S, hd, scale, &A.att[((int64_t)b * H + hh) * S * S],
                                &dO[(int64_t)b * S * D + hh * hd], D, dbase, dbase + D, dbase + 2 * D, 3 * D);
      }
    TR("bwd", l, "attention", "dqkv", dqkv, {N, 3 * D});
    weight_grad(LP(l, "wqkv").g.data(), A.a, D, dqkv, 3 * D, D, 3 * D);
    std::vector<T> da(N * D);
    for (int64_t n = 0; n < N; ++n)
      for (int i = 0; i < D; ++i) {
        T acc = 0;  // reduces over the qkv feature j
        for (int j = 0; j < 3 * D; ++j) acc = FMA(dqkv[n * 3 * D + j], wqkv[(int64_t)i * 3 * D + j], acc);
        da[n * D + i] = acc;
      }
    norm_grad(LP(l, "attn_norm").g.data(), A.x, A.r1, da);
    for (int64_t n = 0; n < N; ++n) {
      rmsnorm_backward(&A.x[n * D], attn_norm, A.r1[n], &da[n * D], dx.data(), D);
      for (int i = 0; i < D; ++i) dh[n * D + i] = dh[n * D + i] + dx[i];
    }
    TR("bwd", l, "attn_norm", "dh", dh, {N, D});
  }
  // Embedding gradients: token reductions of dh over the tokens with that
  // byte (tok_emb) or that position (pos_emb); fold is a plain add.
  T *dte = P("tok_emb").g.data(), *dpe = P("pos_emb").g.data();
  for (int v = 0; v < V; ++v)
    for (int i = 0; i < D; ++i)
      dte[(int64_t)v * D + i] =
          token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return tok(n) == v ? acc + dh[n * D + i] : acc; });
  for (int t = 0; t < S; ++t)
    for (int i = 0; i < D; ++i)
      dpe[(int64_t)t * D + i] =
          token_reduce<T>(N, leaf, [&](int64_t n, T acc) { return n % S == t ? acc + dh[n * D + i] : acc; });
  for (auto& p : params) TR("grad", -1, "param", p.name.c_str(), p.g, p.shape);
  return out;
}

template <class T>
T Model<T>::learning_rate(int step) const {
  const Config& c = cfg;
  if (step < c.warmup_steps) return T(c.lr) * T(step + 1) / T(c.warmup_steps);
  int span = std::max(1, c.decay_steps - c.warmup_steps);
  T progress = T(step - c.warmup_steps) / T(span);
  if (progress > T(1)) progress = T(1);
  T min_lr = T(c.lr) * T(c.min_lr_ratio);
  T coef = T(0.5f) * (T(1) + COS(T(3.14159265358979323846f) * progress));
  return min_lr + (T(c.lr) - min_lr) * coef;
}

template <class T>
T Model<T>::optimizer_step(int step) {
  const Config& c = cfg;
  // Global gradient norm: per tensor a parameter-index reduction (blocks of
  // kParamBlock, canonical tree), tensors summed in canonical name order.
  T total = 0;
  for (auto& p : params) {
    if constexpr (sizeof(T) == 4) {
      total = total + ls::param_sumsq(p.g.data(), p.size());
    } else {
      T s = 0;
      for (T x : p.g) s += x * x;
      total = total + s;
    }
  }
  T norm = SQRT(total);
  if (c.grad_clip > 0 && norm > T(c.grad_clip)) {
    T scale = T(c.grad_clip) / norm;
    for (auto& p : params)
      for (T& x : p.g) x = x * scale;
  }
  const T lr = learning_rate(step);
  const T b1 = T(c.beta1), b2 = T(c.beta2), omb1 = T(1) - b1, omb2 = T(1) - b2;
  T p1 = 1, p2 = 1;  // beta^t by repeated multiplication, t = step + 1
  for (int t = 0; t <= step; ++t) {
    p1 = p1 * b1;
    p2 = p2 * b2;
  }
  const T bc1 = T(1) - p1, bc2 = T(1) - p2;
  for (auto& p : params)
    for (int64_t i = 0; i < p.size(); ++i) {
      T g = p.g[i];
      p.m[i] = b1 * p.m[i] + omb1 * g;
      p.v[i] = b2 * p.v[i] + omb2 * (g * g);
      T mhat = p.m[i] / bc1, vhat = p.v[i] / bc2;
      T upd = mhat / (SQRT(vhat) + T(c.eps));
      if (p.decay) upd = upd + T(c.weight_decay) * p.w[i];
      p.w[i] = p.w[i] - lr * upd;
    }
  return norm;
}

template <class T>
std::string Model<T>::state_hash() const {
  if constexpr (sizeof(T) != sizeof(float)) {
    throw std::logic_error("reference: the state hash is defined for the float model only");
  } else {
    // Canonical names: adam_m/<p>, adam_v/<p>, param/<p>, in bytewise order.
    ls::StateHasher hs;
    for (const char* kind : {"adam_m/", "adam_v/", "param/"})
      for (auto& p : params) {
        const std::vector<float>& data = kind[0] == 'p' ? p.w : kind[5] == 'm' ? p.m : p.v;
        hs.add(kind + p.name, p.shape, data.data());
      }
    return hs.hex();
  }
}

template class Model<float>;
template class Model<double>;

}  // namespace ref
