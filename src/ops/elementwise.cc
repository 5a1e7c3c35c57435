// SwiGLU and the data movement and elementwise steps between ops.
#include "ops/ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/op_profile.h"
#include "common/parallel.h"
#include "contract.h"
#include "ops/dispatch.h"
#include "ops/vmath.h"

namespace ls::ops {

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

void add_row_vector(float* x, int64_t N, int64_t ld, int cols, const float* vec) {
  if (auto k = kernel(&OpHooks::add_row_vector)) return k(x, N, ld, cols, vec);
  for (int64_t n = 0; n < N; ++n)
    for (int e = 0; e < cols; ++e) x[n * ld + e] = x[n * ld + e] + vec[e];
}

void synchronize() {
  if (auto k = kernel(&OpHooks::synchronize)) k();
}

}  // namespace ls::ops
