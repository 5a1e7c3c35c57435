// MoE routing, combine and its backward, and the slot sum of expert rows.
#include "ops/ops.h"

#include <algorithm>

#include "common/op_profile.h"
#include "common/parallel.h"
#include "contract.h"
#include "ops/dispatch.h"

namespace ls::ops {

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

}  // namespace ls::ops
