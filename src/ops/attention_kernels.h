// The register-blocked kernels of causal attention, written once over a
// vector type: attention.cc instantiates them with AVX2 (8 lanes),
// attention_avx512.cc with AVX-512 (16 lanes). Include only from those two
// files; each is built with the instruction set its vector type needs.
//
// Probabilities and score gradients live in the blocked layout of
// attention.h: query positions t in blocks of 16 lanes, key positions u as
// rows. Every fold keeps its order: ascending, from +0.
#pragma once

#include <stdint.h>

#include "ops/transpose8.h"
#include "ops/vmath.h"

namespace ls {
namespace ops {
namespace attention_kernels {

constexpr int kBlock = 16;  // query positions per block of the probability layout

// Offset of (t, u) in the blocked layout of a matrix of U keys per query
// row: block t / 16 holds U rows u of 16 lanes t % 16. t counts the rows
// held (a query range's first row is t = 0); U = S for a whole sequence.
inline int64_t blocked_index(int U, int t, int u) {
  return (int64_t)(t / kBlock) * kBlock * U + (int64_t)u * kBlock + t % kBlock;
}

// The kernels below work on a query range: local rows i = 0..Q-1 are the
// positions t = t_off + i of a sequence, against keys u = 0..t_off+Q-1 (U
// of them). A whole sequence is t_off = 0, Q = U = S; a context-parallel
// rank passes the range it holds (docs/NUMERICS.md §3).

// out[i][:] = fold over u = 0..t_off+i, ascending, from +0, of A(i, u) * M[u][:],
// for the local rows i0 .. i0+rows-1 (inside one 16-block) and the features
// j0 .. j0 + V::kLanes*JV - 1. M holds the U keys' rows.
template <class V, int R, int JV>
void rows_block(const float* A, int U, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo, int i0,
                int rows, int j0) {
  typename V::T acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v] = V::zero();
  const int t0 = t_off + i0;                     // the position of local row i0
  const float* a = A + blocked_index(U, i0, 0);  // a[u * 16 + r] = A(i0 + r, u)
  for (int u = 0; u <= t0; ++u) {  // every row of the block takes the term
    typename V::T m[JV];
    for (int v = 0; v < JV; ++v) m[v] = V::load(M + (int64_t)u * ldm + j0 + V::kLanes * v);
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const typename V::T x = V::set1(a[(int64_t)u * kBlock + r]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(x, m[v], acc[r][v]);
    }
  }
  for (int u = t0 + 1; u < t0 + rows; ++u) {  // only rows t >= u
    typename V::T m[JV];
    for (int v = 0; v < JV; ++v) m[v] = V::load(M + (int64_t)u * ldm + j0 + V::kLanes * v);
    for (int r = u - t0; r < rows; ++r) {
      const typename V::T x = V::set1(a[(int64_t)u * kBlock + r]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(x, m[v], acc[r][v]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < JV; ++v) V::store(out + (int64_t)(i0 + r) * ldo + j0 + V::kLanes * v, acc[r][v]);
}

// out[u][:] = fold over t = max(u, t_off)..t_off+Q-1, ascending, of
// A(t - t_off, u) * M[t - t_off][:], for the keys u0 .. u0+rows-1: from +0,
// or, with `accumulate`, continuing the fold out[u] holds (the queries
// before t_off, folded by the ranks that hold them). M holds the Q rows.
template <class V, int R, int JV>
void cols_block(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo, int u0,
                int rows, int j0, bool accumulate) {
  const int U = t_off + Q, t_end = t_off + Q;
  typename V::T acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v)
      acc[r][v] = accumulate && r < rows ? V::load(out + (int64_t)(u0 + r) * ldo + j0 + V::kLanes * v) : V::zero();
  const int diag_end = u0 + rows < t_end ? u0 + rows : t_end;
  for (int t = u0 > t_off ? u0 : t_off; t < diag_end; ++t) {  // only outputs u <= t
    typename V::T m[JV];
    for (int v = 0; v < JV; ++v) m[v] = V::load(M + (int64_t)(t - t_off) * ldm + j0 + V::kLanes * v);
    const float* a = A + blocked_index(U, t - t_off, u0);  // a[r * 16] = A(t, u0 + r)
    for (int r = 0; r <= t - u0; ++r) {
      const typename V::T x = V::set1(a[(int64_t)r * kBlock]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(x, m[v], acc[r][v]);
    }
  }
  for (int t = u0 + rows > t_off ? u0 + rows : t_off; t < t_end; ++t) {  // every output of the block takes the term
    typename V::T m[JV];
    for (int v = 0; v < JV; ++v) m[v] = V::load(M + (int64_t)(t - t_off) * ldm + j0 + V::kLanes * v);
    const float* a = A + blocked_index(U, t - t_off, u0);
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const typename V::T x = V::set1(a[(int64_t)r * kBlock]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(x, m[v], acc[r][v]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < JV; ++v) V::store(out + (int64_t)(u0 + r) * ldo + j0 + V::kLanes * v, acc[r][v]);
}

// The whole output in blocks (Q local rows, or U = t_off + Q keys; of the
// keys, those in [u_begin, u_end), u_begin a multiple of 16); hd must be a
// multiple of V::kLanes * JV.
template <class V, bool kRows, int JV>
void blocked(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo, int hd,
             bool accumulate, int u_begin, int u_end) {
  constexpr int R = 8 / JV;  // divides 16: a row block never straddles a 16-block of A
  const int U = t_off + Q, n = kRows ? Q : u_end < 0 ? U : u_end;
  for (int j0 = 0; j0 < hd; j0 += V::kLanes * JV)
    for (int i0 = kRows ? 0 : u_begin; i0 < n; i0 += R) {
      const int rows = n - i0 < R ? n - i0 : R;
      if (kRows)
        rows_block<V, R, JV>(A, U, t_off, M, ldm, out, ldo, i0, rows, j0);
      else
        cols_block<V, R, JV>(A, Q, t_off, M, ldm, out, ldo, i0, rows, j0, accumulate);
    }
}

// Picks the widest block the head width allows; hd % V::kLanes == 0.
template <class V, bool kRows>
void fold(const float* A, int Q, int t_off, const float* M, int64_t ldm, float* out, int64_t ldo, int hd,
          bool accumulate, int u_begin = 0, int u_end = -1) {
  if (hd % (4 * V::kLanes) == 0)
    return blocked<V, kRows, 4>(A, Q, t_off, M, ldm, out, ldo, hd, accumulate, u_begin, u_end);
  if (hd % (2 * V::kLanes) == 0)
    return blocked<V, kRows, 2>(A, Q, t_off, M, ldm, out, ldo, hd, accumulate, u_begin, u_end);
  blocked<V, kRows, 1>(A, Q, t_off, M, ldm, out, ldo, hd, accumulate, u_begin, u_end);
}

// xt[j * 16 + l] = X[t0 + l][j] for the block's `lanes` queries, zeros past
// them: the queries of one 16-block as vector lanes.
inline void queries_as_lanes(const float* X, int64_t ldx, int t0, int lanes, int hd, float* xt) {
  int j = 0;
  if (lanes == kBlock)
    for (; j + 8 <= hd; j += 8) {
      transpose8x8(X + (int64_t)t0 * ldx + j, ldx, xt + j * kBlock, kBlock);
      transpose8x8(X + (int64_t)(t0 + 8) * ldx + j, ldx, xt + j * kBlock + 8, kBlock);
    }
  for (; j < hd; ++j)
    for (int l = 0; l < kBlock; ++l) xt[j * kBlock + l] = l < lanes ? X[(int64_t)(t0 + l) * ldx + j] : 0.0f;
}

// One tile of the scores: rows u0 .. u0+rows-1 (rows <= R; all R when
// kFull) of a block, 16 query lanes each.
template <class V, int R, bool kFull>
inline void scores_tile(const float* xt, const float* Y, int64_t ldy, int hd, int u0, int rows, float* ob) {
  constexpr int JV = kBlock / V::kLanes;
  typename V::T acc[R][JV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < JV; ++v) acc[r][v] = V::zero();
  const float* y = Y + (int64_t)u0 * ldy;
  for (int j = 0; j < hd; ++j) {
    typename V::T x[JV];
    for (int v = 0; v < JV; ++v) x[v] = V::load(xt + j * kBlock + v * V::kLanes);
    for (int r = 0; r < R; ++r) {
      if (!kFull && r >= rows) break;
      // fma(Y, X) is fma(X, Y): the product is exact before the one rounding.
      const typename V::T b = V::set1(y[(int64_t)r * ldy + j]);
      for (int v = 0; v < JV; ++v) acc[r][v] = V::fma(b, x[v], acc[r][v]);
    }
  }
  for (int r = 0; r < (kFull ? R : rows); ++r)
    for (int v = 0; v < JV; ++v) V::store(ob + (int64_t)(u0 + r) * kBlock + v * V::kLanes, acc[r][v]);
}

// The causal scores in the blocked layout: out(i, u) = fold over the head
// feature j = 0..hd-1, ascending, from +0, of X[i][j] * Y[u][j], for every
// u <= t_off + i (and the other u of i's 16-block below the diagonal block's
// end, whose values are never read). X holds the Q query rows, Y the keys.
// Reduces over j. xt: scratch of hd * 16 floats.
template <class V>
void scores(const float* X, int64_t ldx, const float* Y, int64_t ldy, int Q, int t_off, int hd, float* out,
            float* xt) {
  constexpr int R = 8;
  const int U = t_off + Q;
  for (int i0 = 0; i0 < Q; i0 += kBlock) {
    const int lanes = Q - i0 < kBlock ? Q - i0 : kBlock;
    queries_as_lanes(X, ldx, i0, lanes, hd, xt);
    const int Ub = t_off + i0 + lanes;  // rows u < Ub: all that any t of the block reads
    float* ob = out + (int64_t)i0 * U;
    int u0 = 0;
    for (; u0 + R <= Ub; u0 += R) scores_tile<V, R, true>(xt, Y, ldy, hd, u0, R, ob);
    if (u0 < Ub) scores_tile<V, R, false>(xt, Y, ldy, hd, u0, Ub - u0, ob);
  }
}

// Scores -> probabilities in place, a 16-block of query rows t side by side
// in lanes: row t is scaled, then the softmax over u <= t as ops::softmax
// does it (the scan's maximum, exp of the shifted score, a sequential sum
// from +0, one division); entries u > t become +0. Reduces over the key
// position u <= t.
template <class V>
void softmax_blocks(float* s, int Q, int t_off, float scale) {
  using T = typename V::T;
  constexpr int L = V::kLanes, JV = kBlock / L;
  T lane[JV];  // t - t0 of each lane
  for (int v = 0; v < JV; ++v) lane[v] = V::add(V::iota(), V::set1((float)(v * L)));
  const T sc = V::set1(scale);
  const int S = t_off + Q;  // keys
  for (int i0 = 0; i0 < Q; i0 += kBlock) {
    const int t0 = t_off + i0;
    const int U = S < t0 + kBlock ? S : t0 + kBlock;
    float* b = s + (int64_t)i0 * S;
    T m[JV], sum[JV];
    // m = z[0]; if (z[u] > m) m = z[u]: the scan, NaNs and signed zeros included.
    for (int v = 0; v < JV; ++v) {
      m[v] = V::mul(V::load(b + v * L), sc);
      V::store(b + v * L, m[v]);
    }
    for (int u = 1; u < U; ++u) {
      const T du = V::set1((float)(u - t0));
      for (int v = 0; v < JV; ++v) {
        const T z = V::mul(V::load(b + u * kBlock + v * L), sc);
        V::store(b + u * kBlock + v * L, z);
        m[v] = V::select(V::both(V::le(du, lane[v]), V::gt(z, m[v])), m[v], z);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int v = 0; v < JV; ++v) V::store(b + u * kBlock + v * L, V::sub(V::load(b + u * kBlock + v * L), m[v]));
    exp_n(b, b, (int64_t)U * kBlock);  // vmath: cexp, bit for bit on every path
    for (int v = 0; v < JV; ++v) sum[v] = V::zero();
    for (int u = 0; u < U; ++u) {
      const T du = V::set1((float)(u - t0));
      for (int v = 0; v < JV; ++v)
        sum[v] = V::select(V::le(du, lane[v]), sum[v], V::add(sum[v], V::load(b + u * kBlock + v * L)));
    }
    for (int u = 0; u < U; ++u) {
      const T du = V::set1((float)(u - t0));
      for (int v = 0; v < JV; ++v) {
        float* p = b + u * kBlock + v * L;
        V::store(p, V::select(V::le(du, lane[v]), V::zero(), V::div(V::load(p), sum[v])));
      }
    }
  }
}

// dp -> dS in place: dS(t, u) = (P * (dp - dot_t)) * scale for u <= t, +0
// otherwise, with dot_t the fma fold of dp * P over u <= t, ascending, from
// +0 (as ops::softmax_backward). Reduces over the key position u <= t.
template <class V>
void softmax_backward_blocks(const float* P, float* dp, int Q, int t_off, float scale) {
  using T = typename V::T;
  constexpr int L = V::kLanes, JV = kBlock / L;
  T lane[JV];
  for (int v = 0; v < JV; ++v) lane[v] = V::add(V::iota(), V::set1((float)(v * L)));
  const T sc = V::set1(scale);
  const int S = t_off + Q;  // keys
  for (int i0 = 0; i0 < Q; i0 += kBlock) {
    const int t0 = t_off + i0;
    const int U = S < t0 + kBlock ? S : t0 + kBlock;
    const float* p = P + (int64_t)i0 * S;
    float* d = dp + (int64_t)i0 * S;
    T dot[JV];
    for (int v = 0; v < JV; ++v) dot[v] = V::zero();
    for (int u = 0; u < U; ++u) {
      const T du = V::set1((float)(u - t0));
      for (int v = 0; v < JV; ++v) {
        const int64_t i = u * kBlock + v * L;
        dot[v] = V::select(V::le(du, lane[v]), dot[v], V::fma(V::load(d + i), V::load(p + i), dot[v]));
      }
    }
    for (int u = 0; u < U; ++u) {
      const T du = V::set1((float)(u - t0));
      for (int v = 0; v < JV; ++v) {
        const int64_t i = u * kBlock + v * L;
        const T g = V::mul(V::mul(V::load(p + i), V::sub(V::load(d + i), dot[v])), sc);
        V::store(d + i, V::select(V::le(du, lane[v]), V::zero(), g));
      }
    }
  }
}

}  // namespace attention_kernels
}  // namespace ops
}  // namespace ls
