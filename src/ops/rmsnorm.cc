#include "ops/ops.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common/numerics_level.h"
#include "common/op_profile.h"
#include "common/parallel.h"
#include "contract.h"
#include "ops/dispatch.h"
#include "ops/local.h"
#include "ops/transpose8.h"

namespace ls::ops {

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

}  // namespace ls::ops
