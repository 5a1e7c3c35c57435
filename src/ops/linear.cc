// Linear layers and their gradients: contract GEMMs, and the weight gradient's
// leaf trees (ops/leaf_grad.h).
#include "ops/ops.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "common/numerics_level.h"
#include "common/op_profile.h"
#include "common/parallel.h"
#include "contract.h"
#include "ops/dispatch.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/leaf_grad.h"
#include "ops/local.h"
#include "ops/vec_avx2.h"

namespace ls::ops {

void matmul(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc, bool accumulate,
            int threads, Operands operands) {
  if (operands == Operands::kFp32 || !bf16_matmuls()) return gemm(M, N, K, A, B, C, ldc, accumulate, threads);
  const OpTimer op_timer(OpKind::kGemm);
  if (auto k = kernel(&OpHooks::gemm_bf16)) return k(M, N, K, A, B, C, ldc, accumulate);  // cuda, cuda-emulated
  if (local_numerics()) return local::gemm_bf16(M, N, K, A, B, C, ldc, accumulate);  // oneDNN's bf16 matmul
  gemm_bf16_rounded(M, N, K, A, B, C, ldc, accumulate, threads);
}

void linear(const float* X, int64_t N, int in, const float* W, int out, float* Y, Operands operands) {
  const OpTimer op_timer(OpKind::kGemm);
  matmul(N, out, in, ConstMat{X, in, 1}, ConstMat{W, out, 1}, Y, out, false, 0, operands);
}

void linear_input_grad(const float* dY, int64_t N, int out, const float* W, int in, float* dX,
                       bool accumulate, Operands operands) {
  const OpTimer op_timer(OpKind::kGemm);
  // B(j, i) = W[i][j]: the transposed view of W.
  matmul(N, in, out, ConstMat{dY, out, 1}, ConstMat{W, 1, out}, dX, in, accumulate, 0, operands);
}

void linear_strided(const float* X, int64_t ldx, int64_t N, int in, const float* W, int64_t ldw, int out, float* Y,
                    int64_t ldy, bool accumulate) {
  const OpTimer op_timer(OpKind::kGemm);
  matmul(N, out, in, ConstMat{X, ldx, 1}, ConstMat{W, ldw, 1}, Y, ldy, accumulate);
}

void linear_input_grad_strided(const float* dY, int64_t lddy, int64_t N, int out, const float* W, int64_t ldw, int in,
                               float* dX, int64_t lddx, bool accumulate) {
  const OpTimer op_timer(OpKind::kGemm);
  matmul(N, in, out, ConstMat{dY, lddy, 1}, ConstMat{W, 1, ldw}, dX, lddx, accumulate);
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

// The contract's weight gradient on the engine (weight_grad without the
// backend, level and precision choices).
void weight_grad_contract(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                          const int64_t* leaf_off, int64_t leaves, float* dW) {
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


}  // namespace

void weight_grad(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                 const int64_t* leaf_off, int64_t leaves, float* dW, Operands operands) {
  const OpTimer op_timer(OpKind::kWeightGrad);
  const bool bf16 = operands != Operands::kFp32 && bf16_matmuls();
  if (auto k = kernel(bf16 ? &OpHooks::weight_grad_bf16 : &OpHooks::weight_grad))  // cuda, cuda-emulated
    return k(X, ldx, dY, ldy, in, out, leaf_off, leaves, dW);
  if (local_numerics())
    return (bf16 ? local::weight_grad_bf16 : local::weight_grad)(X + leaf_off[0] * ldx, ldx, dY + leaf_off[0] * ldy,
                                                                 ldy, in, out, leaf_off[leaves] - leaf_off[0], dW, false);
  if (!bf16) return weight_grad_contract(X, ldx, dY, ldy, in, out, leaf_off, leaves, dW);
  weight_grad_bf16(X, ldx, dY, ldy, in, out, leaf_off, leaves, dW);
}

}  // namespace ls::ops
