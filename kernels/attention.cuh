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
// A query range of Q rows against U keys (ops::attention_range_probs_floats).
__host__ __device__ inline int64_t attention_probs_floats_range(int Q, int U) {
  return (int64_t)((Q + kAttnBlock - 1) / kAttnBlock) * kAttnBlock * U;
}

// The row and column work below runs on a query range (ops/attention.h):
// local row i is position t = t_off + i, the keys are u < U = t_off + Q,
// and the blocked layout holds U rows per block. A whole sequence is
// t_off = 0, Q = U = S.

// Local query row i of one head: its scores, probabilities and output. q,
// o: the range's rows; k, v: every key's.
// bf16_probs (numerics.precision=bf16): P rounded to bf16 (ls::to_bf16)
// before P V, which reads it so, as the backward does.
__device__ inline void attention_forward_row(int i, int t_off, const float* q, int64_t ldq, const float* k,
                                             const float* v, int64_t ldkv, int U, int hd, float scale, float* P,
                                             float* o, int64_t ldo, bool bf16_probs) {
  const int t = t_off + i;
  const float* qt = q + (int64_t)i * ldq;
  float m = 0.0f;
  for (int u = 0; u <= t; ++u) {
    const float* ku = k + (int64_t)u * ldkv;
    float s = 0.0f;
    for (int j = 0; j < hd; ++j) s = ls::fma(qt[j], ku[j], s);
    const float z = s * scale;
    P[attn_index(U, i, u)] = z;
    m = u == 0 || z > m ? z : m;
  }
  float sum = 0.0f;
  for (int u = 0; u <= t; ++u) {
    const float e = ls::cexp(P[attn_index(U, i, u)] - m);
    P[attn_index(U, i, u)] = e;
    sum = sum + e;
  }
  for (int u = 0; u <= t; ++u) {
    const float p = P[attn_index(U, i, u)] / sum;
    P[attn_index(U, i, u)] = bf16_probs ? ls::from_bf16(ls::to_bf16(p)) : p;
  }
  for (int u = t + 1; u < U && u < t_off + (i / kAttnBlock + 1) * kAttnBlock; ++u) P[attn_index(U, i, u)] = 0.0f;
  for (int j = 0; j < hd; ++j) {
    float acc = 0.0f;
    for (int u = 0; u <= t; ++u) acc = ls::fma(P[attn_index(U, i, u)], v[(int64_t)u * ldkv + j], acc);
    o[(int64_t)i * ldo + j] = acc;
  }
}

__global__ void attention_forward_rows(const float* q, const float* k, const float* v, int64_t ld, int S, int hd,
                                       float scale, float* P, float* o, int64_t ldo, bool bf16_probs) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < S) attention_forward_row(t, 0, q, ld, k, v, ld, S, hd, scale, P, o, ldo, bf16_probs);
}

// dS (blocked, the caller's buffer of the range's P size) and dq of local query row i.
__device__ inline void attention_backward_row(int i, int t_off, const float* k, const float* v, int64_t ldkv, int U,
                                              int hd, float scale, const float* P, const float* dO, int64_t ldo,
                                              float* dS, float* dq, int64_t ldd) {
  const int t = t_off + i;
  const float* dot_row = dO + (int64_t)i * ldo;
  float dot = 0.0f;
  for (int u = 0; u <= t; ++u) {
    const float* vu = v + (int64_t)u * ldkv;
    float dp = 0.0f;
    for (int j = 0; j < hd; ++j) dp = ls::fma(dot_row[j], vu[j], dp);
    dS[attn_index(U, i, u)] = dp;
    dot = ls::fma(dp, P[attn_index(U, i, u)], dot);
  }
  for (int u = 0; u <= t; ++u) {
    const int64_t x = attn_index(U, i, u);
    dS[x] = (P[x] * (dS[x] - dot)) * scale;
  }
  for (int j = 0; j < hd; ++j) {
    float acc = 0.0f;
    for (int u = 0; u <= t; ++u) acc = ls::fma(dS[attn_index(U, i, u)], k[(int64_t)u * ldkv + j], acc);
    dq[(int64_t)i * ldd + j] = acc;
  }
}

// One thread per query row t.
__global__ void attention_backward_rows(const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                                        const float* P, const float* dO, int64_t ldo, float* dS, float* dq,
                                        int64_t ldd) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < S) attention_backward_row(t, 0, k, v, ld, S, hd, scale, P, dO, ldo, dS, dq, ldd);
}

// dk and dv of key row u over the range's queries t >= u, after the rows
// wrote dS: from +0, or (accumulate) continuing the fold the rows hold.
__device__ inline void attention_backward_col(int u, int t_off, int Q, const float* q, int64_t ldq, int hd,
                                              const float* P, const float* dS, const float* dO, int64_t ldo, float* dk,
                                              float* dv, int64_t ldd, bool accumulate) {
  const int U = t_off + Q;
  for (int j = 0; j < hd; ++j) {
    float ak = accumulate ? dk[(int64_t)u * ldd + j] : 0.0f, av = accumulate ? dv[(int64_t)u * ldd + j] : 0.0f;
    for (int t = u > t_off ? u : t_off; t < U; ++t) {
      ak = ls::fma(dS[attn_index(U, t - t_off, u)], q[(int64_t)(t - t_off) * ldq + j], ak);
      av = ls::fma(P[attn_index(U, t - t_off, u)], dO[(int64_t)(t - t_off) * ldo + j], av);
    }
    dk[(int64_t)u * ldd + j] = ak;
    dv[(int64_t)u * ldd + j] = av;
  }
}

// One thread per key row u.
__global__ void attention_backward_cols(const float* q, int64_t ld, int S, int hd, const float* P, const float* dS,
                                        const float* dO, int64_t ldo, float* dk, float* dv, int64_t ldd) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u < S) attention_backward_col(u, 0, S, q, ld, hd, P, dS, dO, ldo, dk, dv, ldd, false);
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

__global__ void attention_forward_heads(const float* qkv, int H, int S, int hd, float scale, float* P, float* o,
                                        bool bf16_probs) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= S) return;
  const int D = H * hd;
  const AttnHead a = attn_head(blockIdx.y, H, S, hd);
  const float* base = qkv + a.in;
  attention_forward_row(t, 0, base, 3 * D, base + D, base + 2 * D, 3 * D, S, hd, scale, P + a.probs, o + a.out, D,
                        bf16_probs);
}

__global__ void attention_backward_heads_rows(const float* qkv, int H, int S, int hd, float scale, const float* P,
                                              const float* dO, float* dS, float* dqkv) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= S) return;
  const int D = H * hd;
  const AttnHead a = attn_head(blockIdx.y, H, S, hd);
  attention_backward_row(t, 0, qkv + a.in + D, qkv + a.in + 2 * D, 3 * D, S, hd, scale, P + a.probs, dO + a.out, D,
                         dS + a.probs, dqkv + a.in, 3 * D);
}

__global__ void attention_backward_heads_cols(const float* qkv, int H, int S, int hd, const float* P, const float* dS,
                                              const float* dO, float* dqkv) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= S) return;
  const int D = H * hd;
  const AttnHead a = attn_head(blockIdx.y, H, S, hd);
  attention_backward_col(u, 0, S, qkv + a.in, 3 * D, hd, P + a.probs, dS + a.probs, dO + a.out, D, dqkv + a.in + D,
                         dqkv + a.in + 2 * D, 3 * D, false);
}

// Context parallel (ops::attention_forward_range_heads): the query range
// [first, first + count) of every (sample, head), blockIdx.y = b * H + h;
// head bh keeps the range's P at P + bh * probs_stride + p_off.
__global__ void attention_forward_range_heads(const float* qkv, int H, int S, int hd, float scale, int first,
                                              int count, float* P, int64_t probs_stride, int64_t p_off, float* o,
                                              bool bf16_probs) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int D = H * hd;
  const AttnHead a = attn_head(blockIdx.y, H, S, hd);
  const float* base = qkv + a.in;
  attention_forward_row(i, first, base + (int64_t)first * 3 * D, 3 * D, base + D, base + 2 * D, 3 * D, first + count,
                        hd, scale, P + blockIdx.y * probs_stride + p_off, o + a.out + (int64_t)first * D, D,
                        bf16_probs);
}

// One range of sample b, blockIdx.y = h: the rows (dS, dq), then the columns
// (dk, dv of keys u < first + count). dS: the range's P size per head.
__global__ void attention_backward_range_rows(const float* qkv, int b, int H, int S, int hd, float scale, int first,
                                              int count, const float* P, int64_t probs_stride, int64_t p_off,
                                              const float* dO, float* dS, float* dqkv) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int D = H * hd, U = first + count;
  const AttnHead a = attn_head(b * H + blockIdx.y, H, S, hd);
  const int64_t ds = (int64_t)blockIdx.y * attention_probs_floats_range(count, U);
  attention_backward_row(i, first, qkv + a.in + D, qkv + a.in + 2 * D, 3 * D, U, hd, scale,
                         P + (b * H + blockIdx.y) * probs_stride + p_off, dO + a.out + (int64_t)first * D, D, dS + ds,
                         dqkv + a.in + (int64_t)first * 3 * D, 3 * D);
}

__global__ void attention_backward_range_cols(const float* qkv, int b, int H, int S, int hd, int first, int count,
                                              const float* P, int64_t probs_stride, int64_t p_off, const float* dS,
                                              const float* dO, float* dqkv, bool accumulate) {
  const int u = blockIdx.x * blockDim.x + threadIdx.x;
  const int U = first + count;
  if (u >= U) return;
  const int D = H * hd;
  const AttnHead a = attn_head(b * H + blockIdx.y, H, S, hd);
  const int64_t ds = (int64_t)blockIdx.y * attention_probs_floats_range(count, U);
  attention_backward_col(u, first, count, qkv + a.in + (int64_t)first * 3 * D, 3 * D, hd,
                         P + (b * H + blockIdx.y) * probs_stride + p_off, dS + ds, dO + a.out + (int64_t)first * D, D,
                         dqkv + a.in + D, dqkv + a.in + 2 * D, 3 * D, accumulate);
}

}  // namespace ls::kernels
