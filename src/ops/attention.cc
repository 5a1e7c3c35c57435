#include "ops/attention.h"

#include <algorithm>

#include "contract.h"
#include "ops/ops.h"

namespace ls::ops {
namespace {

// HD > 0: the head width known at compile time (loops over j unroll into
// whole vectors); HD == 0: runtime width hd. Lanes always run over
// independent outputs; every fold stays sequential in its logical index.
template <int HD>
void forward_impl(const float* __restrict q, const float* __restrict k, const float* __restrict v, int64_t ld, int S,
                  int hd_rt, float scale, float* __restrict P, float* __restrict o, int64_t ldo,
                  AttentionScratch& sc) {
  const int hd = HD > 0 ? HD : hd_rt;
  sc.t0.resize((size_t)hd * S);
  sc.t1.resize(S);
  float* __restrict kT = sc.t0.data();
  float* __restrict s = sc.t1.data();
  for (int u = 0; u < S; ++u)
    for (int j = 0; j < hd; ++j) kT[(size_t)j * S + u] = k[u * ld + j];
  for (int t = 0; t < S; ++t) {
    const float* qt = q + t * ld;
    for (int u = 0; u <= t; ++u) s[u] = 0.0f;
    for (int j = 0; j < hd; ++j) {  // lanes over u, each a fold over j
      const float qj = qt[j];
      const float* __restrict kj = kT + (size_t)j * S;
      for (int u = 0; u <= t; ++u) s[u] = ls::fma(qj, kj[u], s[u]);
    }
    for (int u = 0; u <= t; ++u) s[u] = s[u] * scale;
    float* __restrict p = P + (int64_t)t * S;
    softmax(s, p, t + 1);
    float acc[HD > 0 ? HD : 1024];
    for (int j = 0; j < hd; ++j) acc[j] = 0.0f;
    for (int u = 0; u <= t; ++u) {  // lanes over j, each a fold over u
      const float pu = p[u];
      const float* __restrict vu = v + u * ld;
      for (int j = 0; j < hd; ++j) acc[j] = ls::fma(pu, vu[j], acc[j]);
    }
    float* ot = o + t * ldo;
    for (int j = 0; j < hd; ++j) ot[j] = acc[j];
  }
}

template <int HD>
void backward_impl(const float* __restrict q, const float* __restrict k, const float* __restrict v, int64_t ld,
                   int S, int hd_rt, float scale, const float* __restrict P, const float* __restrict dO, int64_t ldo,
                   float* dq, float* dk, float* dv, int64_t ldd, AttentionScratch& sc) {
  const int hd = HD > 0 ? HD : hd_rt;
  sc.t0.resize((size_t)hd * S);
  sc.t1.resize((size_t)S * 2);
  sc.t2.resize((size_t)S * hd * 2);
  float* __restrict vT = sc.t0.data();
  float* __restrict dp = sc.t1.data();
  float* __restrict ds = sc.t1.data() + S;
  // dk, dv accumulate in contiguous scratch (rows of hd), copied out at the end.
  float* __restrict dK = sc.t2.data();
  float* __restrict dV = sc.t2.data() + (size_t)S * hd;
  for (int u = 0; u < S; ++u)
    for (int j = 0; j < hd; ++j) vT[(size_t)j * S + u] = v[u * ld + j];
  std::fill(dK, dK + (size_t)S * hd * 2, 0.0f);
  for (int t = 0; t < S; ++t) {
    const float* __restrict dot = dO + t * ldo;
    const float* __restrict p = P + (int64_t)t * S;
    for (int u = 0; u <= t; ++u) dp[u] = 0.0f;
    for (int j = 0; j < hd; ++j) {  // lanes over u, each a fold over j
      const float dj = dot[j];
      const float* __restrict vj = vT + (size_t)j * S;
      for (int u = 0; u <= t; ++u) dp[u] = ls::fma(dj, vj[u], dp[u]);
    }
    softmax_backward(p, dp, ds, t + 1);
    for (int u = 0; u <= t; ++u) ds[u] = ds[u] * scale;
    const float* __restrict qt = q + t * ld;
    float dqa[HD > 0 ? HD : 1024], qv[HD > 0 ? HD : 1024], dov[HD > 0 ? HD : 1024];
    for (int j = 0; j < hd; ++j) {
      dqa[j] = 0.0f;
      qv[j] = qt[j];
      dov[j] = dot[j];
    }
    for (int u = 0; u <= t; ++u) {  // t ascending outside: dK[u], dV[u] fold over t' in order
      const float dsu = ds[u], pu = p[u];
      const float* __restrict ku = k + u * ld;
      float* __restrict dku = dK + (size_t)u * hd;
      float* __restrict dvu = dV + (size_t)u * hd;
      for (int j = 0; j < hd; ++j) {
        dqa[j] = ls::fma(dsu, ku[j], dqa[j]);
        dku[j] = ls::fma(dsu, qv[j], dku[j]);
        dvu[j] = ls::fma(pu, dov[j], dvu[j]);
      }
    }
    float* dqt = dq + t * ldd;
    for (int j = 0; j < hd; ++j) dqt[j] = dqa[j];
  }
  for (int u = 0; u < S; ++u)
    for (int j = 0; j < hd; ++j) {
      dk[u * ldd + j] = dK[(size_t)u * hd + j];
      dv[u * ldd + j] = dV[(size_t)u * hd + j];
    }
}

}  // namespace

void attention_forward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                       float* P, float* o, int64_t ldo, AttentionScratch& sc) {
  switch (hd) {
    case 8: return forward_impl<8>(q, k, v, ld, S, hd, scale, P, o, ldo, sc);
    case 16: return forward_impl<16>(q, k, v, ld, S, hd, scale, P, o, ldo, sc);
    case 32: return forward_impl<32>(q, k, v, ld, S, hd, scale, P, o, ldo, sc);
    case 64: return forward_impl<64>(q, k, v, ld, S, hd, scale, P, o, ldo, sc);
    case 128: return forward_impl<128>(q, k, v, ld, S, hd, scale, P, o, ldo, sc);
    default: return forward_impl<0>(q, k, v, ld, S, hd, scale, P, o, ldo, sc);
  }
}

void attention_backward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                        const float* P, const float* dO, int64_t ldo, float* dq, float* dk, float* dv, int64_t ldd,
                        AttentionScratch& sc) {
  switch (hd) {
    case 8: return backward_impl<8>(q, k, v, ld, S, hd, scale, P, dO, ldo, dq, dk, dv, ldd, sc);
    case 16: return backward_impl<16>(q, k, v, ld, S, hd, scale, P, dO, ldo, dq, dk, dv, ldd, sc);
    case 32: return backward_impl<32>(q, k, v, ld, S, hd, scale, P, dO, ldo, dq, dk, dv, ldd, sc);
    case 64: return backward_impl<64>(q, k, v, ld, S, hd, scale, P, dO, ldo, dq, dk, dv, ldd, sc);
    case 128: return backward_impl<128>(q, k, v, ld, S, hd, scale, P, dO, ldo, dq, dk, dv, ldd, sc);
    default: return backward_impl<0>(q, k, v, ld, S, hd, scale, P, dO, ldo, dq, dk, dv, ldd, sc);
  }
}

}  // namespace ls::ops
