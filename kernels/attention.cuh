// Causal self-attention of one (sample, head) as CUDA kernels, the bits of
// ops::attention_forward / attention_backward. One thread per query row t
// (forward, and dq) or per key row u (dk, dv); each runs its sequential
// folds in the contract's order:
//   scores s(t, u) = fold over the head feature j of q[t][j] k[u][j];
//   p(t, u) = cexp(s * scale - m) / sum over u <= t (m by scan, sum in order);
//   o[t] = fold over u <= t ascending of p(t, u) v[u];
//   backward: dp(t, u) = fold over j of dO[t][j] v[u][j], dot = fold over
//   u <= t of dp p, dS = (p (dp - dot)) scale; dq[t] = fold over u <= t of
//   dS(t, u) k[u]; dk[u] = fold over t >= u ascending of dS(t, u) q[t];
//   dv[u] = fold over t >= u ascending of p(t, u) dO[t].
// P and dS are kept in the engine's blocked layout (ops/attention.h): query
// positions in blocks of 16, each block S rows of 16 lanes.
#pragma once

#include <cstdint>

#include "contract.h"

namespace ls::kernels {

constexpr int kAttnBlock = 16;  // = ops attention_kernels::kBlock: the layout the engine and the trace read
__host__ __device__ inline int64_t attn_index(int S, int t, int u) {
  return (int64_t)(t / kAttnBlock) * kAttnBlock * S + (int64_t)u * kAttnBlock + t % kAttnBlock;
}
__host__ __device__ inline int64_t attention_probs_floats(int S) { return (int64_t)((S + kAttnBlock - 1) / kAttnBlock) * kAttnBlock * S; }

// Query row t of one head: its scores, probabilities and output.
__device__ inline void attention_forward_row(int t, const float* q, const float* k, const float* v, int64_t ld, int S,
                                             int hd, float scale, float* P, float* o, int64_t ldo) {
  const float* qt = q + (int64_t)t * ld;
  float m = 0.0f;
  for (int u = 0; u <= t; ++u) {
    const float* ku = k + (int64_t)u * ld;
    float s = 0.0f;
    for (int j = 0; j < hd; ++j) s = ls::fma(qt[j], ku[j], s);
    const float z = s * scale;
    P[attn_index(S, t, u)] = z;
    m = u == 0 || z > m ? z : m;
  }
  float sum = 0.0f;
  for (int u = 0; u <= t; ++u) {
    const float e = ls::cexp(P[attn_index(S, t, u)] - m);
    P[attn_index(S, t, u)] = e;
    sum = sum + e;
  }
  for (int u = 0; u <= t; ++u) P[attn_index(S, t, u)] = P[attn_index(S, t, u)] / sum;
  for (int u = t + 1; u < S && u < (t / kAttnBlock + 1) * kAttnBlock; ++u) P[attn_index(S, t, u)] = 0.0f;
  for (int j = 0; j < hd; ++j) {
    float acc = 0.0f;
    for (int u = 0; u <= t; ++u) acc = ls::fma(P[attn_index(S, t, u)], v[(int64_t)u * ld + j], acc);
    o[(int64_t)t * ldo + j] = acc;
  }
}

__global__ void attention_forward_rows(const float* q, const float* k, const float* v, int64_t ld, int S, int hd,
                                       float scale, float* P, float* o, int64_t ldo) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < S) attention_forward_row(t, q, k, v, ld, S, hd, scale, P, o, ldo);
}

// dS (blocked, the caller's buffer of attention_probs_floats(S)) and dq of query row t.
__device__ inline void attention_backward_row(int t, const float* k, const float* v, int64_t ld, int S, int hd,
                                              float scale, const float* P, const float* dO, int64_t ldo, float* dS,
                                              float* dq, int64_t ldd) {
  const float* dot_row = dO + (int64_t)t * ldo;
  float dot = 0.0f;
  for (int u = 0; u <= t; ++u) {
    const float* vu = v + (int64_t)u * ld;
    float dp = 0.0f;
    for (int j = 0; j < hd; ++j) dp = ls::fma(dot_row[j], vu[j], dp);
    dS[attn_index(S, t, u)] = dp;
    dot = ls::fma(dp, P[attn_index(S, t, u)], dot);
  }
  for (int u = 0; u <= t; ++u) {
    const int64_t i = attn_index(S, t, u);
    dS[i] = (P[i] * (dS[i] - dot)) * scale;
  }
  for (int j = 0; j < hd; ++j) {
    float acc = 0.0f;
    for (int u = 0; u <= t; ++u) acc = ls::fma(dS[attn_index(S, t, u)], k[(int64_t)u * ld + j], acc);
    dq[(int64_t)t * ldd + j] = acc;
  }
}

// One thread per query row t.
__global__ void attention_backward_rows(const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                                        const float* P, const float* dO, int64_t ldo, float* dS, float* dq,
                                        int64_t ldd) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < S) attention_backward_row(t, k, v, ld, S, hd, scale, P, dO, ldo, dS, dq, ldd);
}

// dk and dv of key row u, after the rows wrote dS.
__device__ inline void attention_backward_col(int u, const float* q, int64_t ld, int S, int hd, const float* P,
                                              const float* dS, const float* dO, int64_t ldo, float* dk, float* dv,
                                              int64_t ldd) {
  for (int j = 0; j < hd; ++j) {
    float ak = 0.0f, av = 0.0f;
    for (int t = u; t < S; ++t) {
      ak = ls::fma(dS[attn_index(S, t, u)], q[(int64_t)t * ld + j], ak);
      av = ls::fma(P[attn_index(S, t, u)], dO[(int64_t)t * ldo + j], av);
    }
    dk[(int64_t)u * ldd + j] = ak;
    dv[(int64_t)u * ldd + j] = av;
  }
}

// One thread per key row u.
__global__ void attention_backward_cols(const float* q, int64_t ld, int S, int hd, const float* P, const float* dS,
                                        const float* dO, int64_t ldo, float* dk, float* dv, int64_t ldd) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u < S) attention_backward_col(u, q, ld, S, hd, P, dS, dO, ldo, dk, dv, ldd);
}

// Every head of a batch in one launch: blockIdx.y = b * H + h, the model's
// layout (ops::attention_forward_heads): q, k, v of head h of sample b at
// rows b*S.. of qkv [B*S, 3D], columns h*hd, D + h*hd, 2D + h*hd; P (and dS)
// of head bh at bh * attention_probs_floats(S); o, dO [B*S, D] at columns h*hd.
struct AttnHead {
  int64_t in, out, probs;  // offsets into qkv / dqkv, o / dO, P / dS
};
__device__ inline AttnHead attn_head(int bh, int H, int S, int hd) {
  const int64_t b = bh / H, h = bh % H, D = (int64_t)H * hd;
  return AttnHead{b * S * 3 * D + h * hd, b * S * D + h * hd, bh * attention_probs_floats(S)};
}

__global__ void attention_forward_heads(const float* qkv, int H, int S, int hd, float scale, float* P, float* o) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= S) return;
  const int D = H * hd;
  const AttnHead a = attn_head(blockIdx.y, H, S, hd);
  const float* base = qkv + a.in;
  attention_forward_row(t, base, base + D, base + 2 * D, 3 * D, S, hd, scale, P + a.probs, o + a.out, D);
}

__global__ void attention_backward_heads_rows(const float* qkv, int H, int S, int hd, float scale, const float* P,
                                              const float* dO, float* dS, float* dqkv) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= S) return;
  const int D = H * hd;
  const AttnHead a = attn_head(blockIdx.y, H, S, hd);
  attention_backward_row(t, qkv + a.in + D, qkv + a.in + 2 * D, 3 * D, S, hd, scale, P + a.probs, dO + a.out, D,
                         dS + a.probs, dqkv + a.in, 3 * D);
}

__global__ void attention_backward_heads_cols(const float* qkv, int H, int S, int hd, const float* P, const float* dS,
                                              const float* dO, float* dqkv) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= S) return;
  const int D = H * hd;
  const AttnHead a = attn_head(blockIdx.y, H, S, hd);
  attention_backward_col(u, qkv + a.in, 3 * D, S, hd, P + a.probs, dS + a.probs, dO + a.out, D, dqkv + a.in + D,
                         dqkv + a.in + 2 * D, 3 * D);
}

}  // namespace ls::kernels
