// The ops of the `local` numerics level (common/numerics_level.h): the same
// math as the contract ops, computed the way an ordinary fast trainer does.
// OpenBLAS's (or Eigen's) GEMM, at bf16 oneDNN's, weight gradients over all
// tokens at once, the C library's expf, reductions vectorised and split over
// threads in whatever order is fastest for that thread count (fixed for it:
// never the order threads finish). These translation units alone (local.cc,
// local_bf16.cc) are compiled with contraction allowed (-ffp-contract=fast).
// The portable ops call these when the level is local; nothing here obeys
// docs/NUMERICS.md.
#pragma once

#include <stdint.h>

#include <string>

#include "ops/gemm.h"

namespace ls::ops::local {

// C (+)= A·B with OpenBLAS's sgemm where the build found it, else Eigen (each
// with its own blocking over k).
void gemm(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc, bool accumulate);
// What gemm() calls: "OpenBLAS sgemm (CORE)" with the kernel OpenBLAS chose
// for this CPU, or "Eigen" in a build without OpenBLAS.
std::string gemm_library();
// dW (+)= X^T dY over `rows` rows at once (no leaves). Reduces over the token index.
void weight_grad(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out, int64_t rows,
                 float* dW, bool accumulate);

// numerics.precision=bf16 (local_bf16.cc): C (+)= A·B with A and B rounded
// to bf16 (ls::to_bf16) and oneDNN's bf16 matmul, fp32 accumulation and
// output in the library's order. Only in a build with oneDNN
// (have_gemm_bf16(); execution_target refuses local at bf16 without it).
bool have_gemm_bf16();
void gemm_bf16(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc, bool accumulate);
// weight_grad on gemm_bf16: X and dY rounded to bf16. Reduces over the token index.
void weight_grad_bf16(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out, int64_t rows,
                      float* dW, bool accumulate);
// What gemm_bf16 calls: "oneDNN 2.6.3 bf16 matmul (IMPL)" with the
// implementation oneDNN chose for this CPU; "" in a build without oneDNN.
std::string gemm_bf16_library();
// gemm_bf16's calls (with K > 0) in this process so far: tests check oneDNN ran.
int64_t gemm_bf16_calls();
// y = exp(x), the C library's.
void exp_n(const float* x, float* y, int64_t n);
void sigmoid_n(const float* x, float* y, int64_t n);
void exp_shifted_n(const float* x, float m, float* y, int64_t n);
// The C library's logf.
float log(float x);
// As ops::rmsnorm; the sum of squares vectorised (reassociated). Reduces over the feature.
void rmsnorm(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps);
// As ops::rmsnorm_weight_grad: per-thread partials over token ranges, added
// in thread order. Reduces over the token index.
void rmsnorm_weight_grad(const float* x, const float* r, const float* dy, int64_t N, int D, float* dw);
// Sum of squares: per-thread partials over fixed ranges, added in thread
// order (the order depends on the thread count, not on timing).
float param_sumsq(const float* v, int64_t n);
// Sum over tokens, vectorised. Reduces over the token index.
float token_sum(const float* v, int64_t N);
// a*b+c as written: this translation unit lets the compiler fuse it
// (the contract test shows that it does here and does not elsewhere).
float mul_add(float a, float b, float c);

}  // namespace ls::ops::local
