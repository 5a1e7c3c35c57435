#include "ops/ops.h"
#include "common/op_profile.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/parallel.h"
#include "contract.h"
#include "ops/gemm.h"
#include "ops/leaf_grad.h"
#include "ops/transpose8.h"
#include "ops/vec_avx2.h"
#include "ops/vmath.h"
#include "common/numerics_level.h"
#include "ops/local.h"
#include "ops/dispatch.h"

namespace ls::ops {

void linear(const float* X, int64_t N, int in, const float* W, int out, float* Y) {
  const OpTimer op_timer(OpKind::kGemm);
  gemm(N, out, in, ConstMat{X, in, 1}, ConstMat{W, out, 1}, Y, out, false);
}

void linear_input_grad(const float* dY, int64_t N, int out, const float* W, int in, float* dX,
                       bool accumulate) {
  const OpTimer op_timer(OpKind::kGemm);
  // B(j, i) = W[i][j]: the transposed view of W.
  gemm(N, in, out, ConstMat{dY, out, 1}, ConstMat{W, 1, out}, dX, in, accumulate);
}

void linear_strided(const float* X, int64_t ldx, int64_t N, int in, const float* W, int64_t ldw, int out, float* Y,
                    int64_t ldy, bool accumulate) {
  const OpTimer op_timer(OpKind::kGemm);
  gemm(N, out, in, ConstMat{X, ldx, 1}, ConstMat{W, ldw, 1}, Y, ldy, accumulate);
}

void linear_input_grad_strided(const float* dY, int64_t lddy, int64_t N, int out, const float* W, int64_t ldw, int in,
                               float* dX, int64_t lddx, bool accumulate) {
  const OpTimer op_timer(OpKind::kGemm);
  gemm(N, in, out, ConstMat{dY, lddy, 1}, ConstMat{W, 1, ldw}, dX, lddx, accumulate);
}

namespace internal {
// weight_grad_avx512.cc: the leaf_grad.h kernel with 8 x 32 tiles.
int64_t leaf_grad_scratch_floats_avx512(int64_t leaves, int64_t rows);
void leaf_grad_column_tiles_avx512(const float* X, int64_t ldx, const float* dY, int64_t ldy,
                                   const int64_t* leaf_off, int64_t leaves, int i0, int i1, int j0, int j1, float* dW,
                                   int64_t ldw, float* scratch);
}  // namespace internal

namespace {

// The scalar path: per tile (row bands x 64-column slabs) one contract GEMM
// per leaf into the LeafTree, as on a CPU without AVX2.
void weight_grad_by_leaf_gemm(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                              const int64_t* leaf_off, int64_t leaves, float* dW) {
  const int slab = 64;
  const int slabs = (out + slab - 1) / slab;
  // Narrow gradients (wo, router) have one slab: split rows too, so both
  // threads have work (bands of at least 16 rows).
  int bands = 1;
  const int threads = run_inline(2) ? 1 : omp_get_max_threads();
  while (slabs * bands < 2 * threads && in / (2 * bands) >= 16) bands *= 2;
  const int band = (in + bands - 1) / bands;
  const int levels = LeafTree::levels_for(leaves);
  auto run_tile = [&](int s, int b, std::vector<float>& scratch) {
    const int j0 = s * slab, w = std::min(slab, out - j0);
    const int i0 = b * band, h = std::min(band, in - i0);
    if (h <= 0) return;
    scratch.resize((size_t)levels * h * w);
    LeafTree tree(scratch.data(), (int64_t)h * w);
    for (int64_t l = 0; l < leaves; ++l) {
      const int64_t r0 = leaf_off[l], rows = leaf_off[l + 1] - r0;
      // A(i, k) = X[r0 + k][i0 + i]; B(k, j) = dY[r0 + k][j0 + j].
      gemm(h, w, rows, ConstMat{X + r0 * ldx + i0, 1, ldx}, ConstMat{dY + r0 * ldy + j0, ldy, 1},
           tree.next_leaf(), w, false, 1);
      tree.push();
    }
    const float* sum = tree.finish();
    for (int i = 0; i < h; ++i)
      std::copy(sum + (int64_t)i * w, sum + (int64_t)(i + 1) * w, dW + (int64_t)(i0 + i) * out + j0);
  };
  parallel_tasks_with<std::vector<float>>((int64_t)slabs * bands, [&](std::vector<float>& scratch, int64_t t) {
    run_tile((int)(t / bands), (int)(t % bands), scratch);
  });
}

}  // namespace

void weight_grad(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                 const int64_t* leaf_off, int64_t leaves, float* dW) {
  const OpTimer op_timer(OpKind::kWeightGrad);
  if (auto k = kernel(&OpHooks::weight_grad)) return k(X, ldx, dY, ldy, in, out, leaf_off, leaves, dW);
  if (local_numerics())
    return local::weight_grad(X + leaf_off[0] * ldx, ldx, dY + leaf_off[0] * ldy, ldy, in, out,
                              leaf_off[leaves] - leaf_off[0], dW, false);
  const GemmPath path = gemm_path();
  if (path == GemmPath::kScalar) return weight_grad_by_leaf_gemm(X, ldx, dY, ldy, in, out, leaf_off, leaves, dW);
  // Register tiles (leaf_grad.h), each running its whole leaf tree, so bits do
  // not depend on the tiling or the threads. Tasks: one column block of C
  // columns x a group of row blocks (all of them unless the threads need more
  // tasks).
  const bool avx512 = path == GemmPath::kAvx512;
  const int R = avx512 ? 8 : 6, C = avx512 ? 32 : 16;
  const int row_blocks = (in + R - 1) / R, col_blocks = (out + C - 1) / C;
  const int threads = run_inline(2) ? 1 : omp_get_max_threads();
  int groups = 1;
  while (col_blocks * groups < 2 * threads && groups * 2 <= row_blocks) groups *= 2;
  const int64_t rows = leaf_off[leaves] - leaf_off[0];
  const int64_t scratch_floats = avx512 ? internal::leaf_grad_scratch_floats_avx512(leaves, rows)
                                        : leaf_grad::scratch_floats<internal::Avx2, 6, 2>(leaves, rows);
  parallel_tasks((int64_t)col_blocks * groups, [&](int64_t t) {
    // Kept per thread across calls: a fresh vector would malloc and zero it
    // for every call (every expert's every gradient).
    thread_local std::vector<float> scratch;
    if (scratch.size() < (size_t)scratch_floats) scratch.resize((size_t)scratch_floats);
    const int jb = (int)(t / groups), g = (int)(t % groups);
    const int i0 = row_blocks * g / groups * R, i1 = std::min(in, row_blocks * (g + 1) / groups * R);
    const int j0 = jb * C, j1 = std::min(out, j0 + C);
    if (avx512)
      internal::leaf_grad_column_tiles_avx512(X, ldx, dY, ldy, leaf_off, leaves, i0, i1, j0, j1, dW, out,
                                              scratch.data());
    else
      leaf_grad::column_tiles<internal::Avx2, 6, 2>(X, ldx, dY, ldy, leaf_off, leaves, i0, i1, j0, j1, dW, out,
                                                    scratch.data());
  });
}

void rmsnorm(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps) {
  const OpTimer op_timer(OpKind::kNorm);
  if (auto k = kernel(&OpHooks::rmsnorm)) return k(x, w, y, r, N, D, eps);
  if (local_numerics()) return local::rmsnorm(x, w, y, r, N, D, eps);
  // Eight tokens at a time: their sums of squares (each a sequential fold
  // over the feature) run as independent chains side by side.
  parallel_for_groups_of_8(N, [&](int64_t n0, int R) {
    float ss[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const float* xg = x + n0 * D;
    if (R == 8) {  // token k's fold in lane k
      const float* rows[8];
      for (int k = 0; k < 8; ++k) rows[k] = xg + (int64_t)k * D;
      dots8(rows, rows, D, ss);
    } else {
      for (int k = 0; k < R; ++k)
        for (int i = 0; i < D; ++i) ss[k] = ls::fma(xg[k * D + i], xg[k * D + i], ss[k]);
    }
    for (int k = 0; k < R; ++k) {
      const float rn = 1.0f / ls::sqrt(ss[k] / (float)D + eps);
      r[n0 + k] = rn;
      const float* xn = xg + k * D;
      float* yn = y + (n0 + k) * D;
      for (int i = 0; i < D; ++i) yn[i] = (xn[i] * rn) * w[i];
    }
  }, 32);
}

void rmsnorm_debug_reversed(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xn = x + n * D;
    float ss = 0.0f;
    for (int i = D - 1; i >= 0; --i) ss = ls::fma(xn[i], xn[i], ss);
    const float rn = 1.0f / ls::sqrt(ss / (float)D + eps);
    r[n] = rn;
    for (int i = 0; i < D; ++i) y[n * D + i] = (xn[i] * rn) * w[i];
  }
}

void rmsnorm_backward(const float* x, const float* w, const float* r, const float* dy, float* dh,
                      int64_t N, int D, bool accumulate) {
  const OpTimer op_timer(OpKind::kNorm);
  if (auto k = kernel(&OpHooks::rmsnorm_backward)) return k(x, w, r, dy, dh, N, D, accumulate);
  // Eight tokens at a time, their dot products (sequential folds over the
  // feature) side by side.
  parallel_for_groups_of_8(N, [&](int64_t n0, int R) {
    float dot[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const float *xg = x + n0 * D, *dyg = dy + n0 * D, *rg = r + n0;
    if (R == 8) {
      // Token k's fold runs in lane k: eight features at a time, transposed.
      const float *xrows[8], *dyrows[8];
      for (int k = 0; k < 8; ++k) {
        xrows[k] = xg + (int64_t)k * D;
        dyrows[k] = dyg + (int64_t)k * D;
      }
      const __m256 rk = _mm256_loadu_ps(rg);
      __m256 acc = _mm256_setzero_ps();
      int i = 0;
      for (; i + 8 <= D; i += 8) {
        __m256 xc[8], dyc[8];
        columns8(xrows, i, xc);
        columns8(dyrows, i, dyc);
        for (int j = 0; j < 8; ++j)
          acc = _mm256_fmadd_ps(_mm256_mul_ps(dyc[j], _mm256_set1_ps(w[i + j])), _mm256_mul_ps(xc[j], rk), acc);
      }
      _mm256_storeu_ps(dot, acc);
      for (; i < D; ++i)
        for (int k = 0; k < 8; ++k) dot[k] = ls::fma(dyg[k * D + i] * w[i], xg[k * D + i] * rg[k], dot[k]);
    } else {
      for (int k = 0; k < R; ++k)
        for (int i = 0; i < D; ++i) dot[k] = ls::fma(dyg[k * D + i] * w[i], xg[k * D + i] * rg[k], dot[k]);
    }
    for (int k = 0; k < R; ++k) {
      const float rn = rg[k], c = dot[k] / (float)D;
      const float *xn = xg + k * D, *dyn = dyg + k * D;
      float* dhn = dh + (n0 + k) * D;
      if (accumulate) {
        for (int i = 0; i < D; ++i) dhn[i] = dhn[i] + rn * (dyn[i] * w[i] - (xn[i] * rn) * c);
      } else {
        for (int i = 0; i < D; ++i) dhn[i] = rn * (dyn[i] * w[i] - (xn[i] * rn) * c);
      }
    }
  }, 32);
}

void rmsnorm_weight_grad(const float* x, const float* r, const float* dy, int64_t N, int D,
                         int64_t leaf_tokens, float* dw) {
  const OpTimer op_timer(OpKind::kNorm);
  if (auto k = kernel(&OpHooks::rmsnorm_weight_grad)) return k(x, r, dy, N, D, leaf_tokens, dw);
  if (local_numerics()) return local::rmsnorm_weight_grad(x, r, dy, N, D, dw);
  const int64_t leaves = N / leaf_tokens;
  // Blocks of 16 features, each with its own leaf tree: a feature's fold
  // does not depend on which block (or thread) holds it.
  constexpr int kCols = 16;
  const int blocks = (D + kCols - 1) / kCols;
  parallel_tasks_with<std::vector<float>>(blocks, [&](std::vector<float>& scratch, int64_t b) {
    const int i0 = (int)b * kCols, w = std::min(kCols, D - i0);
    scratch.resize((size_t)LeafTree::levels_for(leaves) * w);
    LeafTree tree(scratch.data(), w);
    for (int64_t l = 0; l < leaves; ++l) {
      // A local block the compiler keeps in registers across the leaf's tokens.
      float a[kCols] = {};
      for (int64_t n = l * leaf_tokens; n < (l + 1) * leaf_tokens; ++n) {
        const float *xn = x + n * D + i0, *dyn = dy + n * D + i0;
        const float rn = r[n];
        if (w == kCols)
          for (int i = 0; i < kCols; ++i) a[i] = ls::fma(dyn[i], xn[i] * rn, a[i]);
        else
          for (int i = 0; i < w; ++i) a[i] = ls::fma(dyn[i], xn[i] * rn, a[i]);
      }
      std::copy(a, a + w, tree.next_leaf());
      tree.push();
    }
    const float* sum = tree.finish();
    std::copy(sum, sum + w, dw + i0);
  });
}

float softmax(const float* z, float* p, int n) {
  const OpTimer op_timer(OpKind::kSoftmax);
  float m = z[0];
  for (int e = 1; e < n; ++e)
    if (z[e] > m) m = z[e];
  exp_shifted_n(z, m, p, n);  // p[e] = exp(z[e] - m), bit for bit
  float S = 0.0f;
  for (int e = 0; e < n; ++e) S = S + p[e];
  for (int e = 0; e < n; ++e) p[e] = p[e] / S;
  return m + (local_numerics() ? local::log(S) : ls::clog(S));
}

void softmax_backward(const float* p, const float* dp, float* dz, int n) {
  const OpTimer op_timer(OpKind::kSoftmax);
  float dot = 0.0f;
  for (int e = 0; e < n; ++e) dot = ls::fma(dp[e], p[e], dot);
  for (int e = 0; e < n; ++e) dz[e] = p[e] * (dp[e] - dot);
}

void dots8(const float* const a[8], const float* const b[8], int n, float out[8]) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  if (a == b) {  // sums of squares: one transpose per eight features
    for (; i + 8 <= n; i += 8) {
      __m256 ac[8];
      columns8(a, i, ac);
      for (int j = 0; j < 8; ++j) acc = _mm256_fmadd_ps(ac[j], ac[j], acc);
    }
  }
  for (; i + 8 <= n; i += 8) {  // eight features at a time, transposed: row r in lane r
    __m256 ac[8], bc[8];
    columns8(a, i, ac);
    columns8(b, i, bc);
    for (int j = 0; j < 8; ++j) acc = _mm256_fmadd_ps(ac[j], bc[j], acc);
  }
  _mm256_storeu_ps(out, acc);
  for (; i < n; ++i)
    for (int r = 0; r < 8; ++r) out[r] = ls::fma(a[r][i], b[r][i], out[r]);
}

void sums8(const float* const a[8], int n, float out[8]) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {  // eight entries at a time, transposed: row r in lane r
    __m256 ac[8];
    columns8(a, i, ac);
    for (int j = 0; j < 8; ++j) acc = _mm256_add_ps(acc, ac[j]);
  }
  _mm256_storeu_ps(out, acc);
  for (; i < n; ++i)
    for (int r = 0; r < 8; ++r) out[r] = out[r] + a[r][i];
}

namespace {

// The maximum the sequential scan `m = z[0]; if (z[e] > m) m = z[e]` finds.
// Without NaNs the maximum is order-free, up to the sign of a zero maximum
// (+0 and -0 compare equal, and the scan keeps the first); eight lanes find
// it, and the scan itself runs when a NaN is present or the maximum is zero.
float scan_max(const float* z, int n) {
  if (n >= 16) {
    __m256 mx = _mm256_loadu_ps(z), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
    int e = 8;
    for (; e + 8 <= n; e += 8) {
      const __m256 v = _mm256_loadu_ps(z + e);
      mx = _mm256_max_ps(mx, v);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    float m = lanes[0];
    for (int k = 1; k < 8; ++k) m = lanes[k] > m ? lanes[k] : m;
    for (; e < n; ++e) {
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(_mm256_set1_ps(z[e]), _mm256_set1_ps(z[e]), _CMP_UNORD_Q));
      m = z[e] > m ? z[e] : m;
    }
    if (_mm256_movemask_ps(nan) == 0 && m != 0.0f) return m;
  }
  float m = z[0];
  for (int e = 1; e < n; ++e)
    if (z[e] > m) m = z[e];
  return m;
}

}  // namespace

void softmax_rows(const float* z, int64_t ldz, float* p, int64_t ldp, int rows, int n0, int step, float* lse) {
  const OpTimer op_timer(OpKind::kSoftmax);
  // The kernels take rows of one length with one stride in and out (other layouts keep the engine's op).
  if (auto k = kernel(&OpHooks::softmax_rows); k && step == 0 && ldz == ldp) return k(z, p, ldz, rows, n0, lse);
  // Groups of eight rows in parallel (inline when the caller already runs on the engine's threads).
  parallel_for_groups_of_8(rows, [&](int64_t g0, int R) {
    const int g = (int)g0;
    float m[8], sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int n[8];
    float* pr[8];
    for (int r = 0; r < R; ++r) {
      const float* zr = z + (int64_t)(g + r) * ldz;
      n[r] = n0 + (g + r) * step;
      pr[r] = p + (int64_t)(g + r) * ldp;
      m[r] = scan_max(zr, n[r]);
      exp_shifted_n(zr, m[r], pr[r], n[r]);
    }
    int e = 0;
    if (R == 8) {  // the prefix every row has: eight sequential sums side by side
      sums8(pr, n[0], sum);
      e = n[0];
    }
    for (int r = 0; r < R; ++r) {
      for (int k = e; k < n[r]; ++k) sum[r] = sum[r] + pr[r][k];
      for (int k = 0; k < n[r]; ++k) pr[r][k] = pr[r][k] / sum[r];
      if (lse) lse[g + r] = m[r] + (local_numerics() ? local::log(sum[r]) : ls::clog(sum[r]));
    }
  });
}

void softmax_backward_rows(const float* p, int64_t ldp, const float* dp, int64_t lddp, float* dz, int64_t lddz,
                           int rows, int n0, int step) {
  const OpTimer op_timer(OpKind::kSoftmax);
  // As softmax_rows: rows of one length with one stride.
  if (auto k = kernel(&OpHooks::softmax_backward_rows); k && step == 0 && ldp == lddp && ldp == lddz)
    return k(p, dp, dz, ldp, rows, n0);
  parallel_for_groups_of_8(rows, [&](int64_t g0, int R) {
    const int g = (int)g0;
    float dot[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const float *pr[8], *dpr[8];
    int n[8];
    for (int r = 0; r < R; ++r) {
      n[r] = n0 + (g + r) * step;
      pr[r] = p + (int64_t)(g + r) * ldp;
      dpr[r] = dp + (int64_t)(g + r) * lddp;
    }
    int e = 0;
    if (R == 8) {  // the prefix every row has: eight dot products side by side
      dots8(dpr, pr, n[0], dot);
      e = n[0];
    }
    for (int r = 0; r < R; ++r) {
      for (int k = e; k < n[r]; ++k) dot[r] = ls::fma(dpr[r][k], pr[r][k], dot[r]);
      float* dzr = dz + (int64_t)(g + r) * lddz;
      for (int k = 0; k < n[r]; ++k) dzr[k] = pr[r][k] * (dpr[r][k] - dot[r]);
    }
  });
}

float param_sumsq(const float* v, int64_t n) {
  const OpTimer op_timer(OpKind::kGradNorm);
  if (auto k = kernel(&OpHooks::param_sumsq)) return k(v, n);
  if (local_numerics()) return local::param_sumsq(v, n);
  const int64_t blocks = (n + kParamBlock - 1) / kParamBlock;
  if (blocks <= 1) return ls::sumsq_block(v, n);
  std::vector<float> sums((size_t)blocks);
  param_block_sumsqs(v, n, sums.data());
  return tree_sum(sums.data(), blocks);
}

void param_block_sumsqs(const float* v, int64_t n, float* sums) {
  const int64_t blocks = (n + kParamBlock - 1) / kParamBlock;
  const int64_t full = n / kParamBlock;
  std::fill(sums, sums + full, 0.0f);
  param_piece_sumsqs(v, full, kParamBlock, sums);
  for (int64_t b = full; b < blocks; ++b)
    sums[b] = ls::sumsq_block(v + b * kParamBlock, std::min<int64_t>(kParamBlock, n - b * kParamBlock));
}

void param_piece_sumsqs(const float* v, int64_t pieces, int64_t len, float* acc) {
  int64_t b = 0;
  if (len % 8 == 0) {
    // Sixteen pieces' folds side by side, piece r in lane r % 8 of chain r / 8:
    // two independent fma chains hide the fma latency one chain waits on.
    for (; b + 16 <= pieces; b += 16) {
      __m256 acc0 = _mm256_loadu_ps(acc + b), acc1 = _mm256_loadu_ps(acc + b + 8);
      const float *rows0[8], *rows1[8];
      for (int r = 0; r < 8; ++r) {
        rows0[r] = v + (b + r) * len;
        rows1[r] = v + (b + 8 + r) * len;
      }
      for (int64_t i = 0; i < len; i += 8) {
        __m256 c0[8], c1[8];
        columns8(rows0, i, c0);
        columns8(rows1, i, c1);
        for (int j = 0; j < 8; ++j) {
          acc0 = _mm256_fmadd_ps(c0[j], c0[j], acc0);
          acc1 = _mm256_fmadd_ps(c1[j], c1[j], acc1);
        }
      }
      _mm256_storeu_ps(acc + b, acc0);
      _mm256_storeu_ps(acc + b + 8, acc1);
    }
    for (; b + 8 <= pieces; b += 8) {  // eight pieces' folds side by side, piece r in lane r
      __m256 acc0 = _mm256_loadu_ps(acc + b);
      const float* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = v + (b + r) * len;
      for (int64_t i = 0; i < len; i += 8) {
        __m256 c[8];
        columns8(rows, i, c);
        for (int j = 0; j < 8; ++j) acc0 = _mm256_fmadd_ps(c[j], c[j], acc0);
      }
      _mm256_storeu_ps(acc + b, acc0);
    }
  }
  for (; b < pieces; ++b) {
    float a = acc[b];
    for (int64_t i = 0; i < len; ++i) a = ls::fma(v[b * len + i], v[b * len + i], a);
    acc[b] = a;
  }
}

float token_sum(const float* v, int64_t N, int64_t leaf_tokens) {
  if (auto k = kernel(&OpHooks::token_sum)) return k(v, N, leaf_tokens);
  if (local_numerics()) return local::token_sum(v, N);
  const int64_t leaves = N / leaf_tokens;
  std::vector<float> part((size_t)leaves);
  for (int64_t l = 0; l < leaves; ++l) {
    float acc = 0.0f;
    for (int64_t n = l * leaf_tokens; n < (l + 1) * leaf_tokens; ++n) acc = acc + v[n];
    part[(size_t)l] = acc;
  }
  return tree_sum(part.data(), leaves);
}

void swiglu(const float* u, const float* v, float* s, float* act, int64_t n) {
  const OpTimer op_timer(OpKind::kSwiglu);
  if (auto k = kernel(&OpHooks::swiglu)) return k(u, v, s, act, n);
  // In chunks that stay in L1 between the two passes, chunks in parallel
  // (inline when the caller already runs on the engine's threads).
  constexpr int64_t kChunk = 1024;
  parallel_for((n + kChunk - 1) / kChunk, [&](int64_t c) {
    const int64_t i0 = c * kChunk, m = std::min(kChunk, n - i0);
    sigmoid_n(u + i0, s + i0, m);  // s[i] = csigmoid(u[i]), bit for bit
    for (int64_t i = i0; i < i0 + m; ++i) act[i] = (u[i] * s[i]) * v[i];
  });
}

void swiglu_product(const float* __restrict u, const float* __restrict s, const float* __restrict v,
                    float* __restrict act, int64_t n) {
  const OpTimer op_timer(OpKind::kSwiglu);
  if (auto k = kernel(&OpHooks::swiglu_product)) return k(u, s, v, act, n);
  for (int64_t i = 0; i < n; ++i) act[i] = (u[i] * s[i]) * v[i];
}

void swiglu_backward(const float* u, const float* v, const float* s, const float* dact, float* du, float* dv,
                     int64_t n) {
  const OpTimer op_timer(OpKind::kSwiglu);
  if (auto k = kernel(&OpHooks::swiglu_backward)) return k(u, v, s, dact, du, dv, n);
  constexpr int64_t kChunk = 4096;
  parallel_for((n + kChunk - 1) / kChunk, [&](int64_t c) {
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      dv[i] = dact[i] * (u[i] * s[i]);
      du[i] = (dact[i] * v[i]) * (s[i] * (1.0f + u[i] * (1.0f - s[i])));
    }
  });
}

void route_topk(const float* g_all, int64_t N, int E, int K, int* sel) {
  if (auto k = kernel(&OpHooks::route_topk)) return k(g_all, N, E, K, sel);
  parallel_for(N, [&](int64_t n) { topk_lowest_index(g_all + n * E, E, K, sel + n * K); });
}

void moe_combine(const float* g, int E, const int* sel, int K, const int64_t* row_of, const float* ye_rows,
                 const float* shared, const float* residual, float* hout, int64_t N, int D) {
  const OpTimer op_timer(OpKind::kMoeCombine);
  if (auto k = kernel(&OpHooks::moe_combine)) return k(g, E, sel, K, row_of, ye_rows, shared, residual, hout, N, D);
  parallel_for(N, [&](int64_t n) {
    float out[4096];
    std::fill(out, out + D, 0.0f);
    for (int s = 0; s < K; ++s) {
      const float gate = g[n * E + sel[n * K + s]];
      const float* y = &ye_rows[row_of[n * K + s] * D];
      for (int j = 0; j < D; ++j) out[j] = ls::fma(gate, y[j], out[j]);
    }
    if (shared)
      for (int j = 0; j < D; ++j) out[j] = out[j] + shared[n * D + j];
    for (int j = 0; j < D; ++j) hout[n * D + j] = residual[n * D + j] + out[j];
  });
}

void moe_combine_backward(const float* dh_all, const float* g, int E, const int* sel, int K, const int64_t* row_of,
                          const float* ye_rows, float* dg, float* dye_all, int64_t N, int D) {
  const OpTimer op_timer(OpKind::kMoeCombine);
  if (auto k = kernel(&OpHooks::moe_combine_backward))
    return k(dh_all, g, E, sel, K, row_of, ye_rows, dg, dye_all, N, D);
  // Over (token, slot) pairs q = n*K + s, eight at a time: each gate gradient
  // is a sequential fold over the model feature j; eight run side by side.
  parallel_for_groups_of_8(N * K, [&](int64_t q0, int R) {
    const float *dh[8], *y[8];
    float dgate[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < R; ++r) {
      const int64_t q = q0 + r;
      dh[r] = &dh_all[(q / K) * D];
      y[r] = &ye_rows[row_of[q] * D];
    }
    if (R == 8) {
      dots8(dh, y, D, dgate);
    } else {
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < D; ++j) dgate[r] = ls::fma(dh[r][j], y[r][j], dgate[r]);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t q = q0 + r, n = q / K;
      const int e = sel[q];
      const float gate = g[n * E + e];
      dg[n * E + e] = dgate[r];
      float* dye = &dye_all[row_of[q] * D];
      for (int j = 0; j < D; ++j) dye[j] = gate * dh[r][j];
    }
  });
}

void embed(const int* tok, const float* te, const float* pe, float* h, int64_t N, int S, int D) {
  if (auto k = kernel(&OpHooks::embed)) return k(tok, te, pe, h, N, S, D);
  parallel_for(N, [&](int64_t n) { for (int i = 0; i < D; ++i) h[n * D + i] = te[(int64_t)tok[n] * D + i] + pe[(n % S) * D + i]; });
}

void router_stats(const float* g, const float* lse, int64_t N, int E, int64_t leaf_tokens, int64_t leaves,
                  float* sums) {
  if (auto k = kernel(&OpHooks::router_stats)) return k(g, lse, N, E, leaf_tokens, leaves, sums);
  (void)N;  // = leaves * leaf_tokens
  std::vector<float> part((size_t)leaves * E), zpart(leaves);
  for (int64_t lf = 0; lf < leaves; ++lf) {
    float* acc = &part[(size_t)lf * E];
    float zacc = 0.0f;
    for (int64_t n = lf * leaf_tokens; n < (lf + 1) * leaf_tokens; ++n) {
      for (int e = 0; e < E; ++e) acc[e] = acc[e] + g[n * E + e];
      zacc = ls::fma(lse[n], lse[n], zacc);
    }
    zpart[lf] = zacc;
  }
  std::vector<float> col(leaves);
  for (int e = 0; e < E; ++e) {
    for (int64_t lf = 0; lf < leaves; ++lf) col[lf] = part[(size_t)lf * E + e];
    sums[e] = tree_sum(col.data(), leaves);
  }
  sums[E] = tree_sum(zpart.data(), leaves);
}

void token_losses(const float* lse, const float* logits, const int* target, int64_t N, int V, float* loss) {
  if (auto k = kernel(&OpHooks::token_losses)) return k(lse, logits, target, N, V, loss);
  for (int64_t n = 0; n < N; ++n) loss[n] = lse[n] - logits[n * V + target[n]];
}

void cross_entropy_grad(const float* prob, const int* target, int64_t N, int V, float Ng, float* dlogits) {
  if (auto k = kernel(&OpHooks::cross_entropy_grad)) return k(prob, target, N, V, Ng, dlogits);
  // Dividing by a power of two is scaling by its exact reciprocal: both round
  // the same real number once, so the bits agree (subnormals included), and a
  // multiply is several times cheaper than a divide.
  const bool ng_pow2 = (ls::bits(Ng) & 0x007fffffu) == 0 && Ng >= 1.0f && Ng <= 0x1p126f;
  parallel_for(N, [&](int64_t n) {
    const int y = target[n];
    const float ng = Ng, inv = 1.0f / Ng;  // locals, so the stores below cannot alias them
    float* __restrict dl = &dlogits[n * V];
    const float* __restrict pr = &prob[n * V];
    // (p - onehot) / Ng; p - 0 is p itself (also for -0), so only the target subtracts.
    if (ng_pow2)
      for (int v = 0; v < V; ++v) dl[v] = pr[v] * inv;
    else
      for (int v = 0; v < V; ++v) dl[v] = pr[v] / ng;
    dl[y] = (pr[y] - 1.0f) / ng;
  });
}

// Embedding gradients: per leaf, fold dh of the tokens with that byte (or
// position) in token order with plain adds; leaves by the canonical tree.
// Tasks own blocks of 16 rows (bytes or positions), each with its own leaf
// tree: a row's fold does not depend on the block that holds it.
//
// Most bytes are absent from most leaves. A row's leaf value is a fold of
// adds from +0, so never -0, and so neither is any sum of such values; +0
// is then an exact identity in every add of the tree. Each stack entry
// keeps a mask of the rows that are not +0, and only those are zeroed,
// added and merged: the canonical tree's bits, without its zero rows.
void embedding_grad(const int* tok_id, const float* dh, int64_t N, int S, int D, int V, int64_t leaf_tokens,
                    int64_t leaves, float* gtok, float* gpos) {
  if (auto k = kernel(&OpHooks::embedding_grad)) return k(tok_id, dh, N, S, D, V, leaf_tokens, leaves, gtok, gpos);
  {
    constexpr int64_t kRows = 16;
    const int64_t tok_blocks = (V + kRows - 1) / kRows, pos_blocks = (S + kRows - 1) / kRows;
    parallel_tasks_with<std::vector<float>>(tok_blocks + pos_blocks, [&](std::vector<float>& scratch, int64_t t) {
      const bool by_token = t < tok_blocks;
      const int64_t r0 = (by_token ? t : t - tok_blocks) * kRows;
      const int64_t rows = std::min(kRows, (by_token ? V : S) - r0), width = rows * D;
      scratch.resize((size_t)LeafTree::levels_for(leaves) * width);
      uint32_t mask[64];  // rows of each stack entry that are not +0
      LeafTree tree(scratch.data(), width);  // the canonical tree's schedule; merges are merge() below
      // left += right over the rows right holds: a row only right holds is
      // copied (0 + x is x), one only left holds stays (x + 0 is x).
      auto merge = [&](int d) {
        float *left = &scratch[(size_t)d * width], *right = left + width;
        for (uint32_t m = mask[d + 1]; m; m &= m - 1) {
          const int64_t row = __builtin_ctz(m);
          float *l = left + row * D, *r = right + row * D;
          if (mask[d] >> row & 1)
            for (int i = 0; i < D; ++i) l[i] = l[i] + r[i];
          else
            std::copy(r, r + D, l);
        }
        mask[d] |= mask[d + 1];
      };
      for (int64_t lf = 0; lf < leaves; ++lf) {
        float* acc = tree.next_leaf();
        uint32_t touched = 0;
        // Each row takes its tokens in ascending order, from +0.
        auto add_token = [&](int64_t n, int64_t row) {
          float* dst = acc + row * D;
          if (!(touched >> row & 1)) {
            std::fill(dst, dst + D, 0.0f);
            touched |= 1u << row;
          }
          const float* src = &dh[n * D];
          for (int i = 0; i < D; ++i) dst[i] = dst[i] + src[i];
        };
        if (by_token) {
          for (int64_t n = lf * leaf_tokens; n < (lf + 1) * leaf_tokens; ++n)
            if (tok_id[n] >= r0 && tok_id[n] < r0 + rows) add_token(n, tok_id[n] - r0);
        } else {  // a leaf is whole samples: position p is token s0 + p of each
          for (int64_t s0 = lf * leaf_tokens; s0 < (lf + 1) * leaf_tokens; s0 += S)
            for (int64_t row = 0; row < rows; ++row) add_token(s0 + r0 + row, row);
        }
        mask[tree.depth] = touched;
        tree.push_with(merge);
      }
      tree.finish_with(merge);  // no leaves give +0 (below)
      float* out = (by_token ? gtok : gpos) + r0 * D;
      for (int64_t row = 0; row < rows; ++row) {
        const float* sum = &scratch[(size_t)row * D];
        if (tree.depth > 0 && (mask[0] >> row & 1)) std::copy(sum, sum + D, out + row * D);
        else std::fill(out + row * D, out + (row + 1) * D, 0.0f);
      }
    });
  }
}


void add(const float* a, const float* b, float* out, int64_t n) {
  if (auto k = kernel(&OpHooks::add)) return k(a, b, out, n);
  parallel_for(n, [&](int64_t i) { out[i] = a[i] + b[i]; });
}

void fill(float* p, int64_t n, float value) {
  if (auto k = kernel(&OpHooks::fill)) return k(p, n, value);
  std::fill(p, p + n, value);
}

void copy_rows(const float* src, const int64_t* src_row, float* dst, const int64_t* dst_row, int64_t n,
               int64_t width) {
  if (auto k = kernel(&OpHooks::copy_rows)) return k(src, src_row, dst, dst_row, n, width);
  for (int64_t t = 0; t < n; ++t)
    std::memcpy(dst + (dst_row ? dst_row[t] : t) * width, src + (src_row ? src_row[t] : t) * width,
                sizeof(float) * width);
}

void slot_sum(const float* rows, const int64_t* row_of, int K, int64_t N, int D, float* out) {
  if (auto k = kernel(&OpHooks::slot_sum)) return k(rows, row_of, K, N, D, out);
  parallel_for(N, [&](int64_t n) {
    float* d = out + n * D;
    std::fill(d, d + D, 0.0f);
    for (int s = 0; s < K; ++s) {
      const float* x = rows + row_of[n * K + s] * D;
      for (int i = 0; i < D; ++i) d[i] = d[i] + x[i];
    }
  });
}

void add_row_vector(float* x, int64_t N, int64_t ld, int cols, const float* vec) {
  if (auto k = kernel(&OpHooks::add_row_vector)) return k(x, N, ld, cols, vec);
  for (int64_t n = 0; n < N; ++n)
    for (int e = 0; e < cols; ++e) x[n * ld + e] = x[n * ld + e] + vec[e];
}

void z_loss_grad(const float* g, const float* lse, int64_t N, int E, float two_zw, float Ng, float* dz) {
  if (auto k = kernel(&OpHooks::z_loss_grad)) return k(g, lse, N, E, two_zw, Ng, dz);
  for (int64_t n = 0; n < N; ++n) {
    const float zc = (two_zw * lse[n]) / Ng;
    for (int e = 0; e < E; ++e) dz[n * E + e] = dz[n * E + e] + zc * g[n * E + e];
  }
}

void synchronize() {
  if (auto k = kernel(&OpHooks::synchronize)) k();
}

}  // namespace ls::ops
