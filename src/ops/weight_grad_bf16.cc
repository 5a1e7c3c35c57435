// The contract's bf16 weight gradient (gemm_bf16.h): the leaf's bf16 fold
// over tokens, then the canonical leaf tree over leaves.
//
// amx: X^T and dY are packed once per call, every leaf's rows padded with
// +0 to a multiple of 32 (each leaf's fold starts its own 32-row blocks), A
// strips of 32 features of X and B panels of 32 columns of dY; then each
// 32 x 32 tile of dW runs its whole tree (weight_grad_bf16_amx_32x32): a
// leaf's tile ops from +0, stored to a stack of tiles in L1 that merges as
// LeafTree does. Threads split packing by strip and panel and the tiles by
// (strip, panel), never a leaf's rows. Other paths: one gemm_bf16_rounded
// per leaf over the whole of dW, the leaf tree over those.
#include "ops/gemm_bf16.h"

#include <string.h>

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "numerics/contract.h"
#include "ops/aligned_scratch.h"
#include "ops/dispatch.h"

namespace ls {
namespace ops {
namespace internal {
// gemm_bf16_amx.cc: the packing of a token-row operand (first `lines` of 32
// columns of `rows` rows, the rest +0) as an A strip or a B panel, and the
// tile's tree (merges[l]: LeafTree::merges_on_push(l)); stack: levels x 1024
// floats, 64-byte aligned.
void amx_pack_token_a(const float* src, int64_t rs, int64_t rows, int lines, int64_t kp, uint32_t* dst);
void amx_pack_token_b(const float* src, int64_t rs, int64_t rows, int lines, int64_t kp, uint32_t* dst);
void weight_grad_bf16_amx_32x32(const void* a, const void* b, const int64_t* leaf_kp, int64_t leaves,
                                const int* merges, float* stack, float* c, int64_t ldc, bool load);
}  // namespace internal

namespace {

int64_t padded_pairs(int64_t rows) { return (rows + kBf16FoldBlock - 1) / kBf16FoldBlock * kBf16FoldBlock / 2; }

// The amx path over `leaves` leaves; load (one leaf only): continue from dW.
void weight_grad_amx(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                     const int64_t* leaf_off, int64_t leaves, float* dW, bool load) {
  std::vector<int64_t> leaf_kp((size_t)leaves + 1, 0);
  std::vector<int> merges((size_t)leaves);
  for (int64_t l = 0; l < leaves; ++l) {
    leaf_kp[l + 1] = leaf_kp[l] + padded_pairs(leaf_off[l + 1] - leaf_off[l]);
    merges[l] = LeafTree::merges_on_push(l);
  }
  const int64_t kpt = leaf_kp[leaves];
  const int strips = (in + 31) / 32, panels = (out + 31) / 32;
  static thread_local AlignedScratch<uint32_t> packed;
  uint32_t* a = packed.get((size_t)(strips + panels) * kpt * 32 + 1);
  uint32_t* b = a + (size_t)strips * kpt * 32;
  parallel_tasks(strips + panels, [&](int64_t t) {
    const bool is_a = t < strips;
    const int64_t s = is_a ? t : t - strips;
    const int lines = std::min<int64_t>(32, (is_a ? in : out) - 32 * s);
    for (int64_t l = 0; l < leaves; ++l) {
      const int64_t r0 = leaf_off[l], rows = leaf_off[l + 1] - r0, kp = leaf_kp[l + 1] - leaf_kp[l];
      uint32_t* dst = (is_a ? a : b) + (s * kpt + leaf_kp[l]) * 32;
      if (is_a) internal::amx_pack_token_a(X + r0 * ldx + 32 * s, ldx, rows, lines, kp, dst);
      else internal::amx_pack_token_b(dY + r0 * ldy + 32 * s, ldy, rows, lines, kp, dst);
    }
  });
  const int levels = LeafTree::levels_for(leaves);
  parallel_tasks((int64_t)strips * panels, [&](int64_t t) {
    const int s = (int)(t / panels), p = (int)(t % panels);
    const int rows = std::min(32, in - 32 * s), cols = std::min(32, out - 32 * p);
    static thread_local AlignedScratch<float> scratch;
    float* stack = scratch.get((size_t)(levels + 1) * 1024);
    float* c = dW + (int64_t)32 * s * out + 32 * p;
    if (rows == 32 && cols == 32)
      return internal::weight_grad_bf16_amx_32x32(a + s * kpt * 32, b + p * kpt * 32, leaf_kp.data(), leaves,
                                                  merges.data(), stack, c, out, load);
    float* tile = stack + (int64_t)levels * 1024;  // a partial tile through a full one
    if (load)
      for (int r = 0; r < rows; ++r) memcpy(tile + r * 32, c + (int64_t)r * out, sizeof(float) * cols);
    internal::weight_grad_bf16_amx_32x32(a + s * kpt * 32, b + p * kpt * 32, leaf_kp.data(), leaves, merges.data(),
                                         stack, tile, 32, load);
    for (int r = 0; r < rows; ++r) memcpy(c + (int64_t)r * out, tile + r * 32, sizeof(float) * cols);
  });
}

// A(i, k) = X[k][i], B(k, j) = dY[k][j]: the token rows as the k of a GEMM.
ConstMat x_transposed(const float* X, int64_t ldx) { return ConstMat{X, 1, ldx}; }
ConstMat dy_rows(const float* dY, int64_t ldy) { return ConstMat{dY, ldy, 1}; }

}  // namespace

void weight_grad_bf16(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                      const int64_t* leaf_off, int64_t leaves, float* dW) {
  if (in <= 0 || out <= 0) return;
  if (gemm_bf16_path() == Bf16Path::kAmx)
    return weight_grad_amx(X, ldx, dY, ldy, in, out, leaf_off, leaves, dW, false);
  const int64_t w = (int64_t)in * out;
  if (leaves <= 0) return (void)std::fill(dW, dW + w, 0.0f);
  std::vector<float> slots((size_t)LeafTree::levels_for(leaves) * w);
  LeafTree tree(slots.data(), w);
  for (int64_t l = 0; l < leaves; ++l) {
    const int64_t r0 = leaf_off[l];
    gemm_bf16_rounded(in, out, leaf_off[l + 1] - r0, x_transposed(X + r0 * ldx, ldx), dy_rows(dY + r0 * ldy, ldy),
                      tree.next_leaf(), out, false);
    tree.push();
  }
  const float* sum = tree.finish();
  std::copy(sum, sum + w, dW);
}

void weight_grad_bf16_fold(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out, int64_t rows,
                           float* C, bool accumulate) {
  if (in <= 0 || out <= 0 || (rows <= 0 && accumulate)) return;
  if (auto k = kernel(&OpHooks::gemm_bf16))  // cuda, cuda-emulated: the contract's bf16 GEMM kernel
    return k(in, out, rows, x_transposed(X, ldx), dy_rows(dY, ldy), C, out, accumulate);
  if (gemm_bf16_path() == Bf16Path::kAmx) {
    const int64_t off[2] = {0, rows};
    return weight_grad_amx(X, ldx, dY, ldy, in, out, off, 1, C, accumulate);
  }
  gemm_bf16_rounded(in, out, rows, x_transposed(X, ldx), dy_rows(dY, ldy), C, out, accumulate);
}

void weight_grad_bf16_naive(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                            const int64_t* leaf_off, int64_t leaves, float* dW) {
  std::vector<float> part((size_t)std::max<int64_t>(leaves, 1));
  std::vector<uint16_t> a, b;
  for (int i = 0; i < in; ++i)
    for (int j = 0; j < out; ++j) {
      for (int64_t l = 0; l < leaves; ++l) {
        a.clear();
        b.clear();
        for (int64_t n = leaf_off[l]; n < leaf_off[l + 1]; ++n) {
          a.push_back(ls::to_bf16(X[n * ldx + i]));
          b.push_back(ls::to_bf16(dY[n * ldy + j]));
        }
        part[(size_t)l] = ls::bf16_dot(a.data(), 1, b.data(), 1, (int64_t)a.size(), 0.0f);
      }
      dW[(int64_t)i * out + j] = leaves == 0 ? 0.0f : tree_sum(part.data(), leaves);
    }
}

}  // namespace ops
}  // namespace ls
