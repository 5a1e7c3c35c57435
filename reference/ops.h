// The reference's ops: one token (or one head) at a time, plain loops in
// the contract's order. Templates on the scalar type: float is the contract,
// double (libm math) serves finite-difference gradient checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "contract.h"

namespace ref {


// Scalar primitives: the contract's for float, libm's for double.
inline float FMA(float a, float b, float c) { return ls::fma(a, b, c); }
inline double FMA(double a, double b, double c) { return std::fma(a, b, c); }
inline float EXP(float x) { return ls::cexp(x); }
inline double EXP(double x) { return std::exp(x); }
inline float LOG(float x) { return ls::clog(x); }
inline double LOG(double x) { return std::log(x); }
inline float SQRT(float x) { return ls::sqrt(x); }
inline double SQRT(double x) { return std::sqrt(x); }
inline float SIGMOID(float x) { return ls::csigmoid(x); }
inline double SIGMOID(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline float COS(float x) { return ls::ccos(x); }
inline double COS(double x) { return std::cos(x); }

// The canonical tree over leaf partials (contract rule 3).
template <class T>
T tree(const T* v, int64_t n) {
  if (n <= 0) return T(0);
  if (n == 1) return v[0];
  int64_t p = ls::tree_split(n);
  return tree(v, p) + tree(v + p, n - p);
}

// Reduction over the global token index n in [0, N): `fold(n, acc)` folds
// token n into its leaf's accumulator (from +0, tokens in order); leaves of
// `leaf_tokens` tokens are combined by the canonical tree.
template <class T, class Fold>
T token_reduce(int64_t N, int64_t leaf_tokens, Fold fold) {
  int64_t leaves = N / leaf_tokens;
  std::vector<T> part((size_t)leaves);
  for (int64_t l = 0; l < leaves; ++l) {
    T acc = T(0);
    for (int64_t n = l * leaf_tokens; n < (l + 1) * leaf_tokens; ++n) acc = fold(n, acc);
    part[(size_t)l] = acc;
  }
  return tree(part.data(), leaves);
}


// RMSNorm of one token: out_i = (x_i * r) * w_i, r = 1 / sqrt(ss / D + eps).
// Reduces over the feature index i (ss, fma fold from +0).
template <class T>
T rmsnorm(const T* x, const T* w, T* out, int D, T eps) {
  T ss = 0;
  for (int i = 0; i < D; ++i) ss = FMA(x[i], x[i], ss);
  T r = T(1) / SQRT(ss / T(D) + eps);
  for (int i = 0; i < D; ++i) out[i] = (x[i] * r) * w[i];
  return r;
}

// RMSNorm backward for one token: dx = r * (dxhat - xhat * c),
// c = (sum_i dxhat_i * xhat_i) / D. Reduces over the feature index i.
template <class T>
void rmsnorm_backward(const T* x, const T* w, T r, const T* dout, T* dx, int D) {
  T dot = 0;
  for (int i = 0; i < D; ++i) dot = FMA(dout[i] * w[i], x[i] * r, dot);
  T c = dot / T(D);
  for (int i = 0; i < D; ++i) dx[i] = r * (dout[i] * w[i] - (x[i] * r) * c);
}

// A bf16 run's matrix-product operand: x rounded to bf16 (ls::to_bf16), as
// a float again; x itself when bf16 is false.
template <class T>
T operand(bool bf16, T x) {
  if constexpr (sizeof(T) == sizeof(float)) {
    if (bf16) return ls::from_bf16(ls::to_bf16(x));
  }
  return x;
}

// The feature fold of a matrix product: start + sum over i < n of
// x[i*xs] * w[i*ws], reducing over the feature index i. fp32: the fma fold,
// i ascending. bf16: the contract's bf16 fold (ls::bf16_dot: 32-k blocks,
// even and odd products apart, denormals flushed) of both operands rounded
// to bf16.
template <class T>
T product_fold(bool bf16, const T* x, int64_t xs, const T* w, int64_t ws, int n, T start = T(0)) {
  if (!bf16) {
    T acc = start;
    for (int i = 0; i < n; ++i) acc = FMA(x[i * xs], w[i * ws], acc);
    return acc;
  }
  if constexpr (sizeof(T) == sizeof(float)) {
    thread_local std::vector<uint16_t> a, b;
    a.resize((size_t)n);
    b.resize((size_t)n);
    for (int i = 0; i < n; ++i) {
      a[(size_t)i] = ls::to_bf16(x[i * xs]);
      b[(size_t)i] = ls::to_bf16(w[i * ws]);
    }
    return ls::bf16_dot(a.data(), 1, b.data(), 1, n, start);
  } else {
    throw std::logic_error("ref: bf16 products are the float model's");
  }
}

// The token fold of a weight gradient: sum over the global token index n of
// x * y, where pair(n, &x, &y) gives token n's factors or false when it has
// none (a token not routed to the expert). fp32: token_reduce's fma fold.
// bf16: per leaf the contract's bf16 fold (ls::bf16_dot from +0) over the
// leaf's contributing tokens in order, both factors rounded to bf16; the
// canonical tree over leaves.
template <class T, class Pair>
T token_product_reduce(bool bf16, int64_t N, int64_t leaf_tokens, Pair pair) {
  if (!bf16)
    return token_reduce<T>(N, leaf_tokens, [&](int64_t n, T acc) {
      T x, y;
      return pair(n, &x, &y) ? FMA(x, y, acc) : acc;
    });
  if constexpr (sizeof(T) == sizeof(float)) {
    const int64_t leaves = N / leaf_tokens;
    std::vector<T> part((size_t)leaves);
    std::vector<uint16_t> a, b;
    for (int64_t l = 0; l < leaves; ++l) {
      a.clear();
      b.clear();
      for (int64_t n = l * leaf_tokens; n < (l + 1) * leaf_tokens; ++n) {
        T x, y;
        if (!pair(n, &x, &y)) continue;
        a.push_back(ls::to_bf16(x));
        b.push_back(ls::to_bf16(y));
      }
      part[(size_t)l] = ls::bf16_dot(a.data(), 1, b.data(), 1, (int64_t)a.size(), 0.0f);
    }
    return tree(part.data(), leaves);
  } else {
    throw std::logic_error("ref: bf16 products are the float model's");
  }
}

// y[j] = sum_i x[i] * W[i*ld + j]: reduces over the feature index i.
template <class T>
T dot_col(bool bf16, const T* x, const T* W, int64_t ld, int j, int n) {
  return product_fold(bf16, x, 1, W + j, ld, n);
}

// C[M x N] = A[M x K] · B[K x N], row-major, A and B bf16 (ls::to_bf16
// bits): each output the contract's bf16 fold (docs/NUMERICS.md, "The bf16
// fold"), from +0: k in blocks of 32 (past K, +0 products); per block E over
// the even k and O over the odd k, each from +0 by ls::bf16_fold_step on
// flushed inputs, then C = (E + O) + C by ls::bf16_add_step; a NaN result
// canonical.
inline void matmul_bf16(const uint16_t* A, const uint16_t* B, float* C, int64_t M, int64_t N, int64_t K) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float c = 0.0f;
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        float e = 0.0f, o = 0.0f;
        for (int64_t k = k0; k < k0 + 32; k += 2) {
          const bool in_e = k < K, in_o = k + 1 < K;
          e = ls::bf16_fold_step(e, in_e ? ls::bf16_in(A[i * K + k]) : 0.0f, in_e ? ls::bf16_in(B[k * N + j]) : 0.0f);
          o = ls::bf16_fold_step(o, in_o ? ls::bf16_in(A[i * K + k + 1]) : 0.0f,
                                 in_o ? ls::bf16_in(B[(k + 1) * N + j]) : 0.0f);
        }
        c = ls::bf16_add_step(ls::bf16_add_step(e, o), c);
      }
      C[i * N + j] = ls::bf16_canonical_nan(c);
    }
}

// Softmax over n values, max-shifted: p_e = exp(z_e - m) / S, with S the
// sequential sum over e. Returns log-sum-exp m + log(S).
template <class T>
T softmax(const T* z, T* p, int n) {
  T m = z[0];
  for (int e = 1; e < n; ++e)
    if (z[e] > m) m = z[e];
  T S = 0;
  for (int e = 0; e < n; ++e) {
    p[e] = EXP(z[e] - m);
    S = S + p[e];
  }
  for (int e = 0; e < n; ++e) p[e] = p[e] / S;
  return m + LOG(S);
}

// Softmax backward: dz_e = p_e * (dp_e - sum_e' dp_e' p_e'); reduces over e'.
template <class T>
void softmax_backward(const T* p, const T* dp, T* dz, int n) {
  T dot = 0;
  for (int e = 0; e < n; ++e) dot = FMA(dp[e], p[e], dot);
  for (int e = 0; e < n; ++e) dz[e] = p[e] * (dp[e] - dot);
}

template <class T>
T silu(T u) { return u * SIGMOID(u); }
template <class T>
T silu_grad(T u) {
  T s = SIGMOID(u);
  return s * (T(1) + u * (T(1) - s));
}

// One SwiGLU expert on one token: u = x W1, v = x W3, act = silu(u) * v,
// y = act W2. u, v reduce over the model feature; y over the hidden feature.
template <class T>
void expert_forward(bool bf16, const T* x, const T* W1, const T* W3, const T* W2, int D, int F, T* u, T* v,
                    T* act, T* y) {
  for (int f = 0; f < F; ++f) {
    u[f] = dot_col(bf16, x, W1, F, f, D);
    v[f] = dot_col(bf16, x, W3, F, f, D);
    act[f] = silu(u[f]) * v[f];
  }
  for (int j = 0; j < D; ++j) y[j] = dot_col(bf16, act, W2, D, j, F);
}

// Expert backward on one token, input side: from dy get du, dv (saved for the
// weight gradients) and dx = du W1^T then dv W3^T, one fold over the
// concatenated hidden index [u; v].
template <class T>
void expert_backward(bool bf16, const T* u, const T* v, const T* W1, const T* W3, const T* W2, const T* dy,
                     int D, int F, T* du, T* dv, T* dx) {
  for (int f = 0; f < F; ++f) {
    const T dact = product_fold(bf16, dy, 1, W2 + (int64_t)f * D, 1, D);  // reduces over the model feature j
    dv[f] = dact * silu(u[f]);
    du[f] = (dact * v[f]) * silu_grad(u[f]);
  }
  for (int i = 0; i < D; ++i) {
    // Reduces over the hidden index: the u part, then the v part continuing its fold.
    const T acc = product_fold(bf16, du, 1, W1 + (int64_t)i * F, 1, F);
    dx[i] = product_fold(bf16, dv, 1, W3 + (int64_t)i * F, 1, F, acc);
  }
}


// Causal attention of one (sample, head) over S positions; q, k, v rows have
// stride ld; P (S x S, row t holds u <= t) and o (stride ldo) are written.
// bf16: P rounded to bf16 after the softmax; P V and the backward read it so.
// Scores reduce over the head feature j; outputs over the key position u.
template <class T>
void attention_head(const T* q, const T* k, const T* v, int64_t ld, int S, int hd, T scale, T* P, T* o,
                    int64_t ldo, bool bf16 = false) {
  std::vector<T> s(S);
  for (int t = 0; t < S; ++t) {
    for (int u = 0; u <= t; ++u) {
      T acc = 0;  // reduces over the head feature j
      for (int j = 0; j < hd; ++j) acc = FMA(q[t * ld + j], k[u * ld + j], acc);
      s[u] = acc * scale;
    }
    softmax(s.data(), &P[(int64_t)t * S], t + 1);  // over key position u
    for (int u = 0; u <= t; ++u) P[(int64_t)t * S + u] = operand(bf16, P[(int64_t)t * S + u]);
    for (int j = 0; j < hd; ++j) {
      T acc = 0;  // reduces over the key position u
      for (int u = 0; u <= t; ++u) acc = FMA(P[(int64_t)t * S + u], v[u * ld + j], acc);
      o[t * ldo + j] = acc;
    }
  }
}

// Backward of attention_head: given dO, writes dq, dk, dv (stride ldd).
// dq reduces over u <= t; dk, dv over the query position t' >= u, ascending.
template <class T>
void attention_head_backward(const T* q, const T* k, const T* v, int64_t ld, int S, int hd, T scale, const T* P,
                             const T* dO, int64_t ldo, T* dq, T* dk, T* dv, int64_t ldd) {
  std::vector<T> dS((size_t)S * S, T(0));
  for (int t = 0; t < S; ++t) {
    std::vector<T> dp(t + 1), ds(t + 1);
    for (int u = 0; u <= t; ++u) {
      T acc = 0;  // reduces over the head feature j
      for (int j = 0; j < hd; ++j) acc = FMA(dO[t * ldo + j], v[u * ld + j], acc);
      dp[u] = acc;
    }
    softmax_backward(&P[(int64_t)t * S], dp.data(), ds.data(), t + 1);
    for (int u = 0; u <= t; ++u) dS[(size_t)t * S + u] = ds[u] * scale;
  }
  for (int t = 0; t < S; ++t)
    for (int j = 0; j < hd; ++j) {
      T accq = 0;  // reduces over the key position u <= t
      for (int u = 0; u <= t; ++u) accq = FMA(dS[(size_t)t * S + u], k[u * ld + j], accq);
      T acck = 0, accv = 0;  // reduce over the query position t' >= t
      for (int t2 = t; t2 < S; ++t2) {
        acck = FMA(dS[(size_t)t2 * S + t], q[t2 * ld + j], acck);
        accv = FMA(P[(int64_t)t2 * S + t], dO[t2 * ldo + j], accv);
      }
      dq[t * ldd + j] = accq;
      dk[t * ldd + j] = acck;
      dv[t * ldd + j] = accv;
    }
}

}  // namespace ref
