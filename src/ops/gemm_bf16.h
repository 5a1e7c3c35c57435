// The contract's bf16 GEMM: C (fp32) = A (bf16) · B (bf16), or C += A·B,
// where every output element is the contract's bf16 fold over k
// (ls::bf16_dot, contract_bf16.h): k in blocks of 32, per block the even
// and the odd products in two accumulators, added, then added to C, each
// step rounded once, denormals flushed in and out. Its bits are those of
// the plain loop whatever the path, tiling or thread count. The amx path is
// that fold in hardware (TDPBF16PS); the others replay it.
// numerics.precision=bf16 runs the model's feature folds on it (ops::matmul,
// ops/ops.h).
#pragma once

#include <stdint.h>

#include "ops/gemm.h"

namespace ls {
namespace ops {

// A read-only strided bf16 matrix view (bf16 as its 16 bits, ls::to_bf16):
// element (r, c) is p[r*rs + c*cs].
struct ConstMatBf16 {
  const uint16_t* p;
  int64_t rs;
  int64_t cs;
};

// C[i*ldc + j] = ls::bf16_dot over k = 0..K-1 of A(i,k), B(k,j), from
// (accumulate ? C[i*ldc+j] : +0.0f). K = 0 leaves C (accumulate) or zeroes
// it. A continued fold (accumulate) equals one fold over both ranges only
// when the earlier K was a multiple of 32. threads as ops::gemm: 0 is
// omp_get_max_threads(), or 1 inside a parallel region; parallel over output
// tiles, never over k.
void gemm_bf16(int64_t M, int64_t N, int64_t K, ConstMatBf16 A, ConstMatBf16 B, float* C, int64_t ldc,
               bool accumulate, int threads = 0);

// gemm_bf16 of fp32 operands, each element rounded to bf16 (ls::to_bf16)
// as it is packed: the bits of rounding A and B first, without the copies.
void gemm_bf16_rounded(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc,
                       bool accumulate, int threads = 0);

// The plain loop over ls::bf16_dot: the definition gemm_bf16 must match, for tests.
void gemm_bf16_naive(int64_t M, int64_t N, int64_t K, ConstMatBf16 A, ConstMatBf16 B, float* C,
                     int64_t ldc, bool accumulate);

// The contract's bf16 weight gradient, dW = X^T dY over token rows (X is
// rows x in at ldx, dY rows x out at ldy, dW in x out): per leaf l, each
// output the ls::bf16_dot fold over the leaf's rows leaf_off[l] ..
// leaf_off[l+1]-1 in order from +0 (its 32-row blocks start at the leaf's
// first row), operands rounded to bf16 (ls::to_bf16); then the canonical
// leaf tree (contract.h's LeafTree, fp32 adds) over leaves. An empty leaf is
// +0. Reduces over the token index. The amx path packs both operands once
// and runs each 32 x 32 tile's whole tree on the tile registers; the other
// paths fold a leaf at a time with gemm_bf16_rounded.
void weight_grad_bf16(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                      const int64_t* leaf_off, int64_t leaves, float* dW);
// One leaf's fold over `rows` rows into C (in x out), from +0 or, with
// accumulate, continuing from C: one fold over all the rows given so far
// only when the earlier ones were a multiple of 32 (ops::LeafFold keeps the
// rest of a block back). Reduces over the token index.
void weight_grad_bf16_fold(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out, int64_t rows,
                           float* C, bool accumulate);
// The definition weight_grad_bf16 must match (ls::bf16_dot per leaf, the
// leaf tree), a plain loop, for tests.
void weight_grad_bf16_naive(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                            const int64_t* leaf_off, int64_t leaves, float* dW);
// The amx path's tile configuration is per-thread state that another
// library's AMX kernels (oneDNN's, at numerics.level=local) reconfigure or
// release: whoever calls such a library reports it here after each call
// (it runs no AMX instruction itself), and the amx path loads its
// configuration again before its next tile op on each thread.
namespace internal {
void amx_tiles_clobbered();
}  // namespace internal

// Instruction-set path of gemm_bf16, process-wide, for tests and benchmarks.
// kAuto picks the best the CPU (and, for amx, the OS) supports (amx, else
// avx512-bf16, avx512, avx2, scalar); forcing a path the CPU lacks falls back
// to kAuto's choice. Independent of set_gemm_path. avx512-bf16 (vdpbf16ps)
// computes the contract's steps exactly while every product is a multiple of
// 2^-149 (then every step's sum is one, and none lands between the two
// tininess rules): while the smallest nonzero exponents of A and of B sum to
// -135 or more. That is checked per output tile and k block, on the packed
// bf16 strip and panel; a tile that fails it runs on the avx512 replay
// instead, the same bits.
enum class Bf16Path { kAuto, kScalar, kAvx2, kAvx512, kAvx512Bf16, kAmx };
void set_gemm_bf16_path(Bf16Path path);
Bf16Path gemm_bf16_path();              // the path in use
const char* bf16_path_name(Bf16Path p);  // "scalar", "avx2", "avx512", "avx512-bf16", "amx" (kAuto: "auto")
bool gemm_bf16_path_supported(Bf16Path path);
// Calls of which the avx512-bf16 path handed a tile to avx512, operands that
// small (counted since the process began; for tests and the run summary).
int64_t gemm_bf16_tiny_fallbacks();

}  // namespace ops
}  // namespace ls
