// The parameters' sum of squares for the gradient norm (ls::param_sumsq's bits).
#include "ops/ops.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common/numerics_level.h"
#include "common/op_profile.h"
#include "contract.h"
#include "ops/dispatch.h"
#include "ops/local.h"
#include "ops/transpose8.h"

namespace ls::ops {

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

}  // namespace ls::ops
