// Softmax rows and their backward, and dots8/sums8: eight rows' folds side
// by side, one per vector lane.
#include "ops/ops.h"

#include <immintrin.h>

#include "common/numerics_level.h"
#include "common/op_profile.h"
#include "common/parallel.h"
#include "contract.h"
#include "ops/dispatch.h"
#include "ops/local.h"
#include "ops/transpose8.h"
#include "ops/vmath.h"

namespace ls::ops {

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

}  // namespace ls::ops
