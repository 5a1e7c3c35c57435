#include "ops/attention.h"
#include "common/op_profile.h"

#include <immintrin.h>

#include <algorithm>

#include "common/parallel.h"
#include "common/precision.h"
#include "contract.h"
#include "ops/attention_kernels.h"
#include "ops/bf16_store.h"
#include "ops/gemm.h"
#include "common/numerics_level.h"
#include "ops/local.h"
#include "ops/dispatch.h"
#include "ops/vec_avx2.h"
#include "ops/vmath.h"

namespace ls::ops {
namespace internal {
// attention_avx512.cc: the same kernels with 16-lane vectors.
void causal_rows_avx512(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo,
                        int hd);
void causal_cols_avx512(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo,
                        int hd, bool accumulate, int u_begin, int u_end);
void causal_scores_avx512(const float* X, int64_t ldx, const float* Y, int64_t ldy, int Q, int t_off, int hd,
                          float* out, float* xt);
void softmax_blocks_avx512(float* s, int Q, int t_off, float scale);
void softmax_backward_blocks_avx512(const float* P, float* dp, int Q, int t_off, float scale);
}  // namespace internal
namespace {

using attention_kernels::blocked_index;
using attention_kernels::kBlock;

// The scalar kernels, on a query range as attention_kernels.h: local rows
// i = 0..Q-1 are positions t = t_off + i, keys u = 0..U-1 with U = t_off + Q.

// out[i][:] = fold over u = 0..t_off+i, ascending, from +0, of A(i, u) * M[u][:].
// Reduces over the key position u <= t (the causal prefix of row t).
void causal_rows_scalar(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo,
                        int hd) {
  const int U = t_off + Q;
  for (int i = 0; i < Q; ++i)
    for (int j = 0; j < hd; ++j) {
      float acc = 0.0f;
      for (int u = 0; u <= t_off + i; ++u) acc = ls::fma(A[blocked_index(U, i, u)], M[(int64_t)u * ldm + j], acc);
      out[(int64_t)i * ldo + j] = acc;
    }
}

// out[u][:] = fold over t = max(u, t_off)..U-1, ascending, of A(t - t_off, u) *
// M[t - t_off][:], from +0 or (accumulate) from out[u]'s partial fold, for
// the keys u in [u_begin, u_end). Reduces over the query position t >= u
// (the causal suffix of column u).
void causal_cols_scalar(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo,
                        int hd, bool accumulate, int u_begin, int u_end) {
  const int U = t_off + Q;
  for (int u = u_begin; u < u_end; ++u)
    for (int j = 0; j < hd; ++j) {
      float acc = accumulate ? out[(int64_t)u * ldo + j] : 0.0f;
      for (int t = std::max(u, t_off); t < U; ++t)
        acc = ls::fma(A[blocked_index(U, t - t_off, u)], M[(int64_t)(t - t_off) * ldm + j], acc);
      out[(int64_t)u * ldo + j] = acc;
    }
}

// out(i, u) = fold over j, ascending, from +0, of X[i][j] * Y[u][j], for u <= t_off + i.
// Reduces over the head feature j.
void causal_scores_scalar(const float* X, int64_t ldx, const float* Y, int64_t ldy, int Q, int t_off, int hd,
                          float* out) {
  const int U = t_off + Q;
  for (int i = 0; i < Q; ++i)
    for (int u = 0; u <= t_off + i; ++u) {
      float acc = 0.0f;
      for (int j = 0; j < hd; ++j) acc = ls::fma(X[(int64_t)i * ldx + j], Y[(int64_t)u * ldy + j], acc);
      out[blocked_index(U, i, u)] = acc;
    }
}

// kRows: every query row of the range; else the key rows [u_begin, u_end)
// (u_end < 0: all t_off + Q of them; u_begin a multiple of 16).
template <bool kRows>
void causal(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo, int hd,
            bool accumulate = false, int u_begin = 0, int u_end = -1) {
  if (u_end < 0) u_end = t_off + Q;
  const GemmPath path = gemm_path();
  if (path == GemmPath::kAvx512 && hd % 16 == 0) {
    if (kRows) return internal::causal_rows_avx512(A, Q, t_off, M, ldm, out, ldo, hd);
    return internal::causal_cols_avx512(A, Q, t_off, M, ldm, out, ldo, hd, accumulate, u_begin, u_end);
  }
  if (path != GemmPath::kScalar && hd % 8 == 0)
    return attention_kernels::fold<internal::Avx2, kRows>(A, Q, t_off, M, ldm, out, ldo, hd, accumulate, u_begin,
                                                          u_end);
  if (kRows) return causal_rows_scalar(A, Q, t_off, M, ldm, out, ldo, hd);
  causal_cols_scalar(A, Q, t_off, M, ldm, out, ldo, hd, accumulate, u_begin, u_end);
}

void scores(const float* X, int64_t ldx, const float* Y, int64_t ldy, int Q, int t_off, int hd, float* out,
            std::vector<float>& xt) {
  const GemmPath path = gemm_path();
  if (path == GemmPath::kScalar) return causal_scores_scalar(X, ldx, Y, ldy, Q, t_off, hd, out);
  xt.resize((size_t)hd * kBlock);
  if (path == GemmPath::kAvx512)
    return internal::causal_scores_avx512(X, ldx, Y, ldy, Q, t_off, hd, out, xt.data());
  attention_kernels::scores<internal::Avx2>(X, ldx, Y, ldy, Q, t_off, hd, out, xt.data());
}

// Row t of a block is lane t - t0; it reads u <= t.
inline bool in_row(int u, int t0, int l) { return u <= t0 + l; }

// Scores s -> probabilities P in place, written as plain loops over the 16
// lanes of a block (attention_kernels.h has the vector twin): row t is
// scaled, then softmax over u <= t as ops::softmax does it. Reduces over the
// key position u <= t.
void softmax_blocks_scalar(float* s, int Q, int t_off, float scale) {
  const int S = t_off + Q;  // keys: the layout's rows per block
  for (int i0 = 0; i0 < Q; i0 += kBlock) {
    const int t0 = t_off + i0;
    const int U = std::min(S, t0 + kBlock);
    float* b = s + (int64_t)i0 * S;
    float m[kBlock], sum[kBlock];
    for (int u = 0; u < U; ++u)
      for (int l = 0; l < kBlock; ++l) b[u * kBlock + l] = b[u * kBlock + l] * scale;
    // m = z[0]; if (z[u] > m) m = z[u]: the scan, NaNs and signed zeros included.
    for (int l = 0; l < kBlock; ++l) m[l] = b[l];
    for (int u = 1; u < U; ++u)
      for (int l = 0; l < kBlock; ++l) {
        const float z = b[u * kBlock + l];
        m[l] = in_row(u, t0, l) && z > m[l] ? z : m[l];
      }
    for (int u = 0; u < U; ++u)
      for (int l = 0; l < kBlock; ++l) b[u * kBlock + l] = b[u * kBlock + l] - m[l];
    exp_n(b, b, (int64_t)U * kBlock);  // cexp(z - m), bit for bit
    for (int l = 0; l < kBlock; ++l) sum[l] = 0.0f;
    for (int u = 0; u < U; ++u)
      for (int l = 0; l < kBlock; ++l) sum[l] = in_row(u, t0, l) ? sum[l] + b[u * kBlock + l] : sum[l];
    for (int u = 0; u < U; ++u)
      for (int l = 0; l < kBlock; ++l) b[u * kBlock + l] = in_row(u, t0, l) ? b[u * kBlock + l] / sum[l] : 0.0f;
  }
}

// dp -> dS in place: dS(t, u) = (P * (dp - dot_t)) * scale with dot_t the
// fma fold of dp * P over u <= t, ascending, from +0 (ops::softmax_backward).
// Reduces over the key position u <= t.
void softmax_backward_blocks_scalar(const float* P, float* dp, int Q, int t_off, float scale) {
  const int S = t_off + Q;
  for (int i0 = 0; i0 < Q; i0 += kBlock) {
    const int t0 = t_off + i0;
    const int U = std::min(S, t0 + kBlock);
    const float* p = P + (int64_t)i0 * S;
    float* d = dp + (int64_t)i0 * S;
    float dot[kBlock];
    for (int l = 0; l < kBlock; ++l) dot[l] = 0.0f;
    for (int u = 0; u < U; ++u)
      for (int l = 0; l < kBlock; ++l)
        dot[l] = in_row(u, t0, l) ? ls::fma(d[u * kBlock + l], p[u * kBlock + l], dot[l]) : dot[l];
    for (int u = 0; u < U; ++u)
      for (int l = 0; l < kBlock; ++l) {
        const int64_t i = u * kBlock + l;
        d[i] = in_row(u, t0, l) ? (p[i] * (d[i] - dot[l])) * scale : 0.0f;
      }
  }
}

void softmax_blocks(float* s, int Q, int t_off, float scale) {
  const GemmPath path = gemm_path();
  if (path == GemmPath::kAvx512) return internal::softmax_blocks_avx512(s, Q, t_off, scale);
  if (path == GemmPath::kAvx2) return attention_kernels::softmax_blocks<internal::Avx2>(s, Q, t_off, scale);
  softmax_blocks_scalar(s, Q, t_off, scale);
}

void softmax_backward_blocks(const float* P, float* dp, int Q, int t_off, float scale) {
  const GemmPath path = gemm_path();
  if (path == GemmPath::kAvx512) return internal::softmax_backward_blocks_avx512(P, dp, Q, t_off, scale);
  if (path == GemmPath::kAvx2)
    return attention_kernels::softmax_backward_blocks<internal::Avx2>(P, dp, Q, t_off, scale);
  softmax_backward_blocks_scalar(P, dp, Q, t_off, scale);
}

// fn(first, n) for each block of 16 queries of a query range's blocked P:
// the n entries from `first` that hold its keys u < min(U, t0 + 16), the
// only ones any op reads (the rest lie above every row's diagonal).
template <class Fn>
void for_each_probs_block(int Q, int t_off, Fn fn) {
  const int U = t_off + Q;
  for (int i0 = 0; i0 < Q; i0 += kBlock) fn((int64_t)i0 * U, (int64_t)std::min(U, t_off + i0 + kBlock) * kBlock);
}

// The contract's attention of a query range (attention.h). At bf16 P is
// rounded to bf16 before P V, which reads it so, as the backward does.
void forward_range(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q, int t_off,
                   int hd, float scale, float* P, float* o, int64_t ldo, AttentionScratch& sc) {
  scores(q, ldq, k, ldkv, Q, t_off, hd, P, sc.t1);  // s(t, u) over the feature j
  softmax_blocks(P, Q, t_off, scale);               // row t over u <= t
  if (bf16_matmuls()) for_each_probs_block(Q, t_off, [&](int64_t first, int64_t n) { round_bf16_n(P + first, n); });
  causal<true>(P, Q, t_off, v, ldkv, o, ldo, hd);   // o over u <= t
}

void backward_range(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q, int t_off,
                    int hd, float scale, const float* P, const float* dO, int64_t ldo, float* dq, int64_t lddq,
                    float* dk, float* dv, int64_t lddkv, bool continue_kv, AttentionScratch& sc) {
  sc.t0.resize((size_t)attention_range_probs_floats(Q, t_off));
  float* dS = sc.t0.data();
  scores(dO, ldo, v, ldkv, Q, t_off, hd, dS, sc.t1);                 // dp(t, u) over the feature j
  softmax_backward_blocks(P, dS, Q, t_off, scale);                    // row t over u <= t
  causal<true>(dS, Q, t_off, k, ldkv, dq, lddq, hd);                  // dq over u <= t
  causal<false>(dS, Q, t_off, q, ldq, dk, lddkv, hd, continue_kv);    // dk over t >= u
  causal<false>(P, Q, t_off, dO, ldo, dv, lddkv, hd, continue_kv);    // dv over t >= u
}

// numerics.level=local: the scores and probabilities of a query range (Q
// rows against its U = t_off + Q keys; the whole sequence is t_off = 0) a
// block of kLocalRows queries at a time, each block against the keys up to
// its last query only (the causal mask skips about half of the products),
// every product one GEMM (ops/local.h), the softmax with the C library's
// exp; P is still written in the blocked layout the backward and the trace
// read.
constexpr int kLocalRows = 128;

void forward_range_local(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q,
                         int t_off, int hd, float scale, float* P, float* o, int64_t ldo, AttentionScratch& sc) {
  const int U = t_off + Q;
  const bool bf16 = bf16_matmuls();
  std::fill(P, P + attention_range_probs_floats(Q, t_off), 0.0f);
  for (int i0 = 0; i0 < Q; i0 += kLocalRows) {
    const int n = std::min(kLocalRows, Q - i0), Ub = t_off + i0 + n;  // the block's keys: u < Ub
    sc.t1.resize((size_t)n * Ub);
    float* z = sc.t1.data();
    local::gemm(n, Ub, hd, ConstMat{q + (int64_t)i0 * ldq, ldq, 1}, ConstMat{k, 1, ldkv}, z, Ub, false);  // q_t . k_u
    for (int r = 0; r < n; ++r) {
      const int i = i0 + r, t = t_off + i;
      float* row = z + (int64_t)r * Ub;
      float m = row[0] * scale;
      for (int u = 0; u <= t; ++u) m = std::max(m, row[u] * scale);
      for (int u = 0; u <= t; ++u) row[u] = row[u] * scale - m;
      local::exp_n(row, row, t + 1);
      float sum = 0.0f;
      for (int u = 0; u <= t; ++u) sum += row[u];
      for (int u = 0; u <= t; ++u) {
        const float p = row[u] / sum;
        P[blocked_index(U, i, u)] = row[u] = bf16 ? ls::from_bf16(ls::to_bf16(p)) : p;  // bf16: P V reads it rounded
      }
      std::fill(row + t + 1, row + Ub, 0.0f);
    }
    local::gemm(n, hd, Ub, ConstMat{z, Ub, 1}, ConstMat{v, ldkv, 1}, o + (int64_t)i0 * ldo, ldo, false);
  }
}

// dk, dv of the U keys: (accumulate) added to what they hold, else written.
void backward_range_local(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q, int t_off,
                          int hd, float scale, const float* P, const float* dO, int64_t ldo, float* dq, int64_t lddq,
                          float* dk, float* dv, int64_t lddkv, bool accumulate, AttentionScratch& sc) {
  const int U = t_off + Q;
  if (!accumulate)  // the blocks add into every key row they reach
    for (int u = 0; u < U; ++u) {
      std::fill(dk + (int64_t)u * lddkv, dk + (int64_t)u * lddkv + hd, 0.0f);
      std::fill(dv + (int64_t)u * lddkv, dv + (int64_t)u * lddkv + hd, 0.0f);
    }
  for (int i0 = 0; i0 < Q; i0 += kLocalRows) {
    const int n = std::min(kLocalRows, Q - i0), Ub = t_off + i0 + n;
    sc.t0.resize((size_t)n * Ub);
    sc.t1.resize((size_t)n * Ub);
    float *p = sc.t1.data(), *d = sc.t0.data();
    for (int r = 0; r < n; ++r)
      for (int u = 0; u < Ub; ++u) p[(int64_t)r * Ub + u] = u <= t_off + i0 + r ? P[blocked_index(U, i0 + r, u)] : 0.0f;
    const float* dOb = dO + (int64_t)i0 * ldo;
    local::gemm(n, Ub, hd, ConstMat{dOb, ldo, 1}, ConstMat{v, 1, ldkv}, d, Ub, false);  // dp(t, u) = dO_t . v_u
    for (int r = 0; r < n; ++r) {
      const int t = t_off + i0 + r;
      float *dr = d + (int64_t)r * Ub, *pr = p + (int64_t)r * Ub;
      float dot = 0.0f;
      for (int u = 0; u <= t; ++u) dot += dr[u] * pr[u];
      for (int u = 0; u < Ub; ++u) dr[u] = u <= t ? pr[u] * (dr[u] - dot) * scale : 0.0f;
    }
    local::gemm(n, hd, Ub, ConstMat{d, Ub, 1}, ConstMat{k, ldkv, 1}, dq + (int64_t)i0 * lddq, lddq, false);  // dS K
    local::gemm(Ub, hd, n, ConstMat{d, 1, Ub}, ConstMat{q + (int64_t)i0 * ldq, ldq, 1}, dk, lddkv, true);    // dS^T Q
    local::gemm(Ub, hd, n, ConstMat{p, 1, Ub}, ConstMat{dOb, ldo, 1}, dv, lddkv, true);                      // P^T dO
  }
}

void attention_forward_local(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                             float* P, float* o, int64_t ldo, AttentionScratch& sc) {
  forward_range_local(q, ld, k, v, ld, S, 0, hd, scale, P, o, ldo, sc);
}

void attention_backward_local(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                              const float* P, const float* dO, int64_t ldo, float* dq, float* dk, float* dv,
                              int64_t ldd, AttentionScratch& sc) {
  backward_range_local(q, ld, k, v, ld, S, 0, hd, scale, P, dO, ldo, dq, ldd, dk, dv, ldd, false, sc);
}

}  // namespace

int64_t attention_range_probs_floats(int Q, int t_off) {
  return (int64_t)((Q + kBlock - 1) / kBlock) * kBlock * (t_off + Q);
}

float attention_range_prob(const float* P, int Q, int t_off, int i, int u) {
  return P[blocked_index(t_off + Q, i, u)];
}

int64_t attention_probs_floats(int S) { return attention_range_probs_floats(S, 0); }

float attention_prob(const float* P, int S, int t, int u) { return P[blocked_index(S, t, u)]; }

void attention_forward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                       float* P, float* o, int64_t ldo, AttentionScratch& sc) {
  const OpTimer op_timer(OpKind::kAttention);
  if (local_numerics()) return attention_forward_local(q, k, v, ld, S, hd, scale, P, o, ldo, sc);
  forward_range(q, ld, k, v, ld, S, 0, hd, scale, P, o, ldo, sc);
}

void attention_backward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                        const float* P, const float* dO, int64_t ldo, float* dq, float* dk, float* dv, int64_t ldd,
                        AttentionScratch& sc) {
  const OpTimer op_timer(OpKind::kAttention);
  if (local_numerics()) return attention_backward_local(q, k, v, ld, S, hd, scale, P, dO, ldo, dq, dk, dv, ldd, sc);
  backward_range(q, ld, k, v, ld, S, 0, hd, scale, P, dO, ldo, dq, ldd, dk, dv, ldd, false, sc);
}

void attention_forward_range(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q,
                             int t_off, int hd, float scale, float* P, float* o, int64_t ldo,
                             AttentionScratch& sc) {
  const OpTimer op_timer(OpKind::kAttention);
  if (local_numerics()) return forward_range_local(q, ldq, k, v, ldkv, Q, t_off, hd, scale, P, o, ldo, sc);
  forward_range(q, ldq, k, v, ldkv, Q, t_off, hd, scale, P, o, ldo, sc);
}

void attention_backward_range(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q,
                              int t_off, int hd, float scale, const float* P, const float* dO, int64_t ldo,
                              float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv, bool continue_kv,
                              AttentionScratch& sc) {
  const OpTimer op_timer(OpKind::kAttention);
  if (local_numerics())
    return backward_range_local(q, ldq, k, v, ldkv, Q, t_off, hd, scale, P, dO, ldo, dq, lddq, dk, dv, lddkv,
                                continue_kv, sc);
  backward_range(q, ldq, k, v, ldkv, Q, t_off, hd, scale, P, dO, ldo, dq, lddq, dk, dv, lddkv, continue_kv, sc);
}
namespace {

// A bf16 store's P of a query range (Q queries from t_off, its entries from
// `at`) as fp32 in `out` (the range's layout): every entry read, or the keys
// [u0, u1) of each block.
void unpack_probs(const uint16_t* at, int Q, int t_off, float* out, int u0 = 0, int u1 = -1) {
  for_each_probs_block(Q, t_off, [&](int64_t first, int64_t n) {
    const int64_t lo = std::min<int64_t>(n, (int64_t)u0 * kBlock), hi = u1 < 0 ? n : std::min<int64_t>(n, (int64_t)u1 * kBlock);
    if (hi > lo) from_bf16_n(at + first + lo, out + first + lo, hi - lo);
  });
}

// Chunk c of a range (the queries [c, c + n) of Q from t_off) kept in the
// range's layout, and that chunk as a range of its own: block b of the chunk
// is block c / 16 + b of the range, with fewer keys per block. Calls
// fn(the block's first entry in the range's store, in the chunk, count).
template <class Fn>
void for_each_chunk_block(int Q, int t_off, int c, int n, Fn fn) {
  const int64_t U = t_off + Q, Uc = t_off + c + n;
  for_each_probs_block(n, t_off + c, [&](int64_t first, int64_t count) {
    fn((int64_t)c * U + first / Uc * U, first, count);  // first / Uc: the chunk's query offset of the block
  });
}
// chunk -> store (rounded, already bf16 values).
void store_chunk(uint16_t* store, int Q, int t_off, int c, int n, const float* chunk) {
  for_each_chunk_block(Q, t_off, c, n, [&](int64_t at, int64_t first, int64_t count) {
    to_bf16_n(chunk + first, store + at, count);
  });
}
// store -> chunk.
void load_chunk(const uint16_t* store, int Q, int t_off, int c, int n, float* chunk) {
  for_each_chunk_block(Q, t_off, c, n, [&](int64_t at, int64_t first, int64_t count) {
    from_bf16_n(store + at, chunk + first, count);
  });
}

// attention_forward_range keeping P in a store (from `at` entries): a bf16
// store a chunk at a time, the chunk's P in scratch.
void forward_range_stored(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q, int t_off,
                          int hd, float scale, ProbsStore P, int64_t at, float* o, int64_t ldo, AttentionScratch& sc) {
  if (!P.bf16) return attention_forward_range(q, ldq, k, v, ldkv, Q, t_off, hd, scale, P.f32 + at, o, ldo, sc);
  for (int c = 0; c < Q; c += kProbsChunk) {
    const int n = std::min(kProbsChunk, Q - c);
    sc.probs.resize((size_t)attention_range_probs_floats(n, t_off + c));
    attention_forward_range(q + c * ldq, ldq, k, v, ldkv, n, t_off + c, hd, scale, sc.probs.data(), o + c * ldo, ldo,
                            sc);
    store_chunk(P.bf16 + at, Q, t_off, c, n, sc.probs.data());
  }
}

// attention_backward_range reading P from a store: a bf16 one a chunk at a
// time, each chunk continuing the keys' folds (chained in ascending t_off,
// the whole range's bits), from rows zeroed first unless continue_kv.
void backward_range_stored(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q, int t_off,
                           int hd, float scale, ProbsView P, int64_t at, const float* dO, int64_t ldo, float* dq,
                           int64_t lddq, float* dk, float* dv, int64_t lddkv, bool continue_kv, AttentionScratch& sc) {
  if (!P.bf16)
    return attention_backward_range(q, ldq, k, v, ldkv, Q, t_off, hd, scale, P.f32 + at, dO, ldo, dq, lddq, dk, dv,
                                    lddkv, continue_kv, sc);
  if (!continue_kv)
    for (int u = 0; u < t_off + Q; ++u) {
      std::fill(dk + (int64_t)u * lddkv, dk + (int64_t)u * lddkv + hd, 0.0f);
      std::fill(dv + (int64_t)u * lddkv, dv + (int64_t)u * lddkv + hd, 0.0f);
    }
  for (int c = 0; c < Q; c += kProbsChunk) {
    const int n = std::min(kProbsChunk, Q - c);
    sc.probs.resize((size_t)attention_range_probs_floats(n, t_off + c));
    load_chunk(P.bf16 + at, Q, t_off, c, n, sc.probs.data());
    attention_backward_range(q + c * ldq, ldq, k, v, ldkv, n, t_off + c, hd, scale, sc.probs.data(), dO + c * ldo, ldo,
                             dq + c * lddq, lddq, dk, dv, lddkv, true, sc);
  }
}

// The fp32 P of a query range from `at` in a store: the store's own, or a
// bf16 store's (the keys [u0, u1) of each block; u1 < 0: all) in `scratch`.
const float* probs_f32(ProbsView P, int64_t at, int Q, int t_off, std::vector<float>& scratch, int u0 = 0,
                       int u1 = -1) {
  if (!P.bf16) return P.f32 + at;
  scratch.resize((size_t)attention_range_probs_floats(Q, t_off));
  unpack_probs(P.bf16 + at, Q, t_off, scratch.data(), u0, u1);
  return scratch.data();
}

// A kernel backend keeps P in fp32 (its hooks take floats): the forward's to
// write, the backward's to read.
float* kernel_probs(ProbsStore P) {
  if (P.bf16) throw std::logic_error("attention: a kernel backend keeps P in fp32, not bf16");
  return P.f32;
}
const float* kernel_probs(ProbsView P) {
  if (P.bf16) throw std::logic_error("attention: a kernel backend keeps P in fp32, not bf16");
  return P.f32;
}

}  // namespace

void attention_forward_heads(const float* qkv, int B, int H, int S, int hd, float scale, ProbsStore P, float* o) {
  if (auto k = kernel(&OpHooks::attention_forward_heads)) {
    const OpTimer op_timer(OpKind::kAttention);
    return k(qkv, B, H, S, hd, scale, kernel_probs(P), o, bf16_matmuls());
  }
  const int D = H * hd;
  const int64_t probs = attention_probs_floats(S), ld = 3 * (int64_t)D;
  parallel_tasks_with<AttentionScratch>((int64_t)B * H, [&](AttentionScratch& scratch, int64_t bh) {
    const int b = (int)(bh / H), hh = (int)(bh % H);
    const float* base = qkv + (int64_t)b * S * ld + (int64_t)hh * hd;
    forward_range_stored(base, ld, base + D, base + 2 * D, ld, S, 0, hd, scale, P, bh * probs,
                         o + (int64_t)b * S * D + (int64_t)hh * hd, D, scratch);
  });
}

void attention_backward_heads(const float* qkv, int B, int H, int S, int hd, float scale, ProbsView P,
                              const float* dO, float* dqkv) {
  if (auto k = kernel(&OpHooks::attention_backward_heads)) {
    const OpTimer op_timer(OpKind::kAttention);
    return k(qkv, B, H, S, hd, scale, kernel_probs(P), dO, dqkv);
  }
  const int D = H * hd;
  const int64_t probs = attention_probs_floats(S), ld = 3 * (int64_t)D;
  parallel_tasks_with<AttentionScratch>((int64_t)B * H, [&](AttentionScratch& scratch, int64_t bh) {
    const int b = (int)(bh / H), hh = (int)(bh % H);
    const int64_t in = (int64_t)b * S * ld + (int64_t)hh * hd;
    backward_range_stored(qkv + in, ld, qkv + in + D, qkv + in + 2 * D, ld, S, 0, hd, scale, P, bh * probs,
                          dO + (int64_t)b * S * D + (int64_t)hh * hd, D, dqkv + in, ld, dqkv + in + D,
                          dqkv + in + 2 * D, ld, false, scratch);
  });
}

void attention_forward_range_heads(const float* qkv, int B, int H, int S, int hd, float scale, int first, int count,
                                   ProbsStore P, int64_t probs_stride, int64_t p_off, float* o) {
  if (auto k = kernel(&OpHooks::attention_forward_range_heads)) {
    const OpTimer op_timer(OpKind::kAttention);
    return k(qkv, B, H, S, hd, scale, first, count, kernel_probs(P), probs_stride, p_off, o, bf16_matmuls());
  }
  const int D = H * hd;
  const int64_t ld = 3 * (int64_t)D;
  parallel_tasks_with<AttentionScratch>((int64_t)B * H, [&](AttentionScratch& scratch, int64_t bh) {
    const int b = (int)(bh / H), hh = (int)(bh % H);
    const float* base = qkv + (int64_t)b * S * ld + (int64_t)hh * hd;  // row 0 of sample b, head hh
    forward_range_stored(base + first * ld, ld, base + D, base + 2 * D, ld, count, first, hd, scale, P,
                         bh * probs_stride + p_off, o + ((int64_t)b * S + first) * D + (int64_t)hh * hd, D, scratch);
  });
}

void attention_backward_range_heads(const float* qkv, int b, int H, int S, int hd, float scale, int first, int count,
                                    ProbsView P, int64_t probs_stride, int64_t p_off, const float* dO, float* dqkv,
                                    bool continue_kv) {
  if (auto k = kernel(&OpHooks::attention_backward_range_heads)) {
    const OpTimer op_timer(OpKind::kAttention);
    return k(qkv, b, H, S, hd, scale, first, count, kernel_probs(P), probs_stride, p_off, dO, dqkv, continue_kv);
  }
  const int D = H * hd;
  const int64_t ld = 3 * (int64_t)D, row0 = (int64_t)b * S;
  parallel_tasks_with<AttentionScratch>(H, [&](AttentionScratch& scratch, int64_t hh) {
    const float* base = qkv + row0 * ld + hh * hd;
    float* dbase = dqkv + row0 * ld + hh * hd;
    backward_range_stored(base + first * ld, ld, base + D, base + 2 * D, ld, count, first, hd, scale, P,
                          ((int64_t)b * H + hh) * probs_stride + p_off, dO + (row0 + first) * D + hh * hd, D,
                          dbase + first * ld, ld, dbase + D, dbase + 2 * D, ld, continue_kv, scratch);
  });
}

void attention_backward_range_dq_heads(const float* qkv, int b, int H, int h0, int h1, int S, int hd, float scale,
                                       int first, int count, ProbsView P, int64_t probs_stride, int64_t p_off,
                                       const float* dO, float* dS, float* dqkv) {
  const OpTimer op_timer(OpKind::kAttention);
  const int D = H * hd;
  const int64_t ld = 3 * (int64_t)D, row0 = (int64_t)b * S, per_head = attention_range_probs_floats(count, first);
  parallel_tasks_with<AttentionScratch>(h1 - h0, [&](AttentionScratch& scratch, int64_t i) {
    const int64_t hh = h0 + i;
    const float* base = qkv + row0 * ld + hh * hd;
    float* ds = dS + i * per_head;
    const float* p = probs_f32(P, ((int64_t)b * H + hh) * probs_stride + p_off, count, first, scratch.probs);
    scores(dO + (row0 + first) * D + hh * hd, D, base + 2 * D, ld, count, first, hd, ds, scratch.t1);  // dp over j
    softmax_backward_blocks(p, ds, count, first, scale);
    causal<true>(ds, count, first, base + D, ld, dqkv + (row0 + first) * ld + hh * hd, ld, hd);  // dq over u <= t
  });
}

void attention_backward_range_dkv_heads(const float* qkv, int b, int H, int h0, int h1, int S, int hd, int first,
                                        int count, ProbsView P, int64_t probs_stride, int64_t p_off,
                                        const float* dS, const float* dO, float* dqkv, int u0, int u1) {
  const OpTimer op_timer(OpKind::kAttention);
  const int D = H * hd;
  const int64_t ld = 3 * (int64_t)D, row0 = (int64_t)b * S, per_head = attention_range_probs_floats(count, first);
  parallel_tasks_with<AttentionScratch>(h1 - h0, [&](AttentionScratch& scratch, int64_t i) {
    const int64_t hh = h0 + i;
    const float* base = qkv + row0 * ld + hh * hd;
    float* dbase = dqkv + row0 * ld + hh * hd;
    const float* p = probs_f32(P, ((int64_t)b * H + hh) * probs_stride + p_off, count, first, scratch.probs, u0, u1);
    // dk and dv over t >= u, continuing each key's fold (+0 where nothing came before).
    causal<false>(dS + i * per_head, count, first, base + first * ld, ld, dbase + D, ld, hd, true, u0, u1);
    causal<false>(p, count, first, dO + (row0 + first) * D + hh * hd, D, dbase + 2 * D, ld, hd, true, u0, u1);
  });
}

}  // namespace ls::ops
