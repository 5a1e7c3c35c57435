#include "ops/local.h"

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <Eigen/Core>
#ifdef LOCKSTEP_HAVE_OPENBLAS
#include <cblas.h>
#endif

#include "common/parallel.h"

// glibc's libmvec: expf on eight floats (AVX2).
extern "C" __m256 _ZGVdN8v_expf(__m256 x);

namespace ls::ops::local {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ColMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
using RowMap = Eigen::Map<const RowMajor, 0, Eigen::OuterStride<>>;
using ColMap = Eigen::Map<const ColMajor, 0, Eigen::OuterStride<>>;

// Calls f with an Eigen view of the strided matrix (rows x cols): row- or
// column-major when one stride is 1, else a packed copy.
template <class F>
void with_view(ConstMat m, int64_t rows, int64_t cols, F&& f) {
  if (m.cs == 1) return f(RowMap(m.p, rows, cols, Eigen::OuterStride<>(m.rs)));
  if (m.rs == 1) return f(ColMap(m.p, rows, cols, Eigen::OuterStride<>(m.cs)));
  RowMajor copy(rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) copy(r, c) = m.p[r * m.rs + c * m.cs];
  f(RowMap(copy.data(), rows, cols, Eigen::OuterStride<>(cols)));
}

}  // namespace

#ifdef LOCKSTEP_HAVE_OPENBLAS
namespace {

// A strided matrix as BLAS takes it: row-major with leading dimension ld,
// transposed or not; a matrix with neither stride 1 is packed first.
struct BlasView {
  const float* p;
  CBLAS_TRANSPOSE trans;
  int64_t ld;
  std::vector<float> packed;
};

void blas_view(ConstMat m, int64_t rows, int64_t cols, BlasView& v) {
  if (m.cs == 1) {
    v = {m.p, CblasNoTrans, m.rs, {}};
  } else if (m.rs == 1) {
    v = {m.p, CblasTrans, m.cs, {}};  // the transpose of a row-major cols x rows matrix
  } else {
    v.packed.resize((size_t)(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) v.packed[(size_t)(r * cols + c)] = m.p[r * m.rs + c * m.cs];
    v.p = v.packed.data();
    v.trans = CblasNoTrans;
    v.ld = cols;
  }
}

}  // namespace
#endif

std::string gemm_library() {
#ifdef LOCKSTEP_HAVE_OPENBLAS
  // The kernel OpenBLAS picked for this CPU (OPENBLAS_CORETYPE overrides it).
  return std::string("OpenBLAS sgemm (") + openblas_get_corename() + ")";
#else
  return "Eigen";
#endif
}

void gemm(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * (size_t)N);
    return;
  }
  // Inside the engine's own parallel work the library must stay on this
  // thread (an OpenMP team of its own would oversubscribe the cores).
  const bool nested = in_pool_job() || omp_in_parallel();
  const int saved = omp_get_max_threads();
  if (nested) omp_set_num_threads(1);
#ifdef LOCKSTEP_HAVE_OPENBLAS
  BlasView a, b;
  blas_view(A, M, K, a);
  blas_view(B, K, N, b);
  // ld of a transposed operand counts its stored (row-major) rows' stride.
  cblas_sgemm(CblasRowMajor, a.trans, b.trans, (blasint)M, (blasint)N, (blasint)K, 1.0f, a.p, (blasint)a.ld, b.p,
              (blasint)b.ld, accumulate ? 1.0f : 0.0f, C, (blasint)ldc);
#else
  Eigen::Map<RowMajor, 0, Eigen::OuterStride<>> c(C, M, N, Eigen::OuterStride<>(ldc));
  with_view(A, M, K, [&](const auto& a) {
    with_view(B, K, N, [&](const auto& b) {
      if (accumulate) c.noalias() += a * b;
      else c.noalias() = a * b;
    });
  });
#endif
  if (nested) omp_set_num_threads(saved);
}

void weight_grad(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out, int64_t rows,
                 float* dW, bool accumulate) {
  // dW(i, j) = sum_n X(n, i) dY(n, j): A = X^T (a column-major view of X).
  local::gemm(in, out, rows, ConstMat{X, 1, ldx}, ConstMat{dY, ldy, 1}, dW, out, accumulate);
}

// The C library's vector expf (glibc's libmvec, 8 lanes, AVX2), as a
// compiler with -ffast-math would call it; the scalar expf for the tail.
template <class Pre, class Post>
void exp_lanes(const float* x, float* y, int64_t n, Pre pre, Post post) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, post(_ZGVdN8v_expf(pre(_mm256_loadu_ps(x + i)))));
  for (; i < n; ++i) {
    float v[8] = {x[i]};
    __m256 r = post(_ZGVdN8v_expf(pre(_mm256_loadu_ps(v))));
    y[i] = _mm256_cvtss_f32(r);
  }
}

void exp_n(const float* x, float* y, int64_t n) {
  exp_lanes(x, y, n, [](__m256 v) { return v; }, [](__m256 e) { return e; });
}

void sigmoid_n(const float* x, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  exp_lanes(x, y, n, [&](__m256 v) { return _mm256_sub_ps(zero, v); },
            [&](__m256 e) { return _mm256_div_ps(one, _mm256_add_ps(one, e)); });
}

void exp_shifted_n(const float* x, float m, float* y, int64_t n) {
  const __m256 mv = _mm256_set1_ps(m);
  exp_lanes(x, y, n, [&](__m256 v) { return _mm256_sub_ps(v, mv); }, [](__m256 e) { return e; });
}

float log(float x) { return std::log(x); }

void rmsnorm(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps) {
#pragma omp parallel for schedule(static) if (N >= 64 && !omp_in_parallel() && !in_pool_job())
  for (int64_t n = 0; n < N; ++n) {
    const float* xn = x + n * D;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < D; ++i) ss += xn[i] * xn[i];
    const float rn = 1.0f / std::sqrt(ss / (float)D + eps);
    r[n] = rn;
    for (int i = 0; i < D; ++i) y[n * D + i] = xn[i] * rn * w[i];
  }
}

void rmsnorm_weight_grad(const float* x, const float* r, const float* dy, int64_t N, int D, float* dw) {
  const int threads = omp_in_parallel() || in_pool_job() ? 1 : omp_get_max_threads();
  std::vector<float> part((size_t)threads * D, 0.0f);
#pragma omp parallel num_threads(threads)
  {
    float* mine = part.data() + (size_t)omp_get_thread_num() * D;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      for (int i = 0; i < D; ++i) mine[i] += dy[n * D + i] * x[n * D + i] * r[n];
  }
  std::memset(dw, 0, sizeof(float) * D);
  for (int t = 0; t < threads; ++t)  // in thread order
    for (int i = 0; i < D; ++i) dw[i] += part[(size_t)t * D + i];
}

float param_sumsq(const float* v, int64_t n) {
  // OpenMP's reduction(+) would add the threads' partials as they finish
  // (libgomp: in arrival order, which varies run to run from 3 threads on);
  // like ATen's parallel_reduce, each thread sums a fixed range into its
  // slot and the slots are added in thread order.
  auto range = [v](int64_t lo, int64_t hi) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; ++i) s += v[i] * v[i];
    return s;
  };
  const int threads = n >= (1 << 16) && !omp_in_parallel() && !in_pool_job() ? omp_get_max_threads() : 1;
  if (threads == 1) return range(0, n);
  std::vector<float> part((size_t)threads, 0.0f);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    part[(size_t)t] = range(n * t / team, n * (t + 1) / team);
  }
  float s = 0.0f;
  for (float x : part) s += x;  // in thread order
  return s;
}

float token_sum(const float* v, int64_t N) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t n = 0; n < N; ++n) s += v[n];
  return s;
}

float mul_add(float a, float b, float c) { return a * b + c; }

}  // namespace ls::ops::local
