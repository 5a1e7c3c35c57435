// The contract's bf16 GEMM as a CUDA kernel: C = A·B (or C += A·B) over fp32
// operands rounded to bf16 as they are read (ls::to_bf16), where every
// output element is the contract's bf16 fold over k (ls::bf16_dot,
// contract_bf16.h): the bits of ops::gemm_bf16_rounded. Reduces over k, in
// 32-k blocks in order: a thread keeps a TM x TN tile of C (and of the
// block's even and odd accumulators) in registers across the whole k loop;
// shared memory stages one fold block of each operand, already rounded and
// flushed. Compiled by nvcc (-fmad=false) and, for the checks without a GPU,
// by g++ against kernels/emu/cuda_emu.h.
#pragma once

#include <cstdint>

#include "contract.h"
#include "gemm.cuh"

namespace ls::kernels {

// An fp32 value as a bf16 input of the fold: rounded, then flushed (DAZ).
LS_HD float bf16_operand(float x) { return ls::bf16_in(ls::to_bf16(x)); }

// ls::bf16_dot over fp32 operands rounded as read: a[k*as] and b[k*bs] for
// k = 0..K-1, from `start`. Reduces over k, with ls::bf16_dot's blocks,
// steps and flushes, so its bits are that function's on the rounded values.
LS_HD float bf16_dot_rounded(const float* a, int64_t as, const float* b, int64_t bs, int64_t K, float start) {
  if (K <= 0) return start;
  float c = ls::bf16_flush(start);
  for (int64_t k0 = 0; k0 < K; k0 += ls::kBf16FoldBlock) {
    float e = 0.0f, o = 0.0f;
    for (int64_t k = k0; k < k0 + ls::kBf16FoldBlock; k += 2) {  // past K: +0 * +0, as bf16_dot pads
      e = ls::bf16_fold_step(e, k < K ? bf16_operand(a[k * as]) : 0.0f, k < K ? bf16_operand(b[k * bs]) : 0.0f);
      o = ls::bf16_fold_step(o, k + 1 < K ? bf16_operand(a[(k + 1) * as]) : 0.0f,
                             k + 1 < K ? bf16_operand(b[(k + 1) * bs]) : 0.0f);
    }
    c = ls::bf16_add_step(ls::bf16_add_step(e, o), c);
  }
  return ls::bf16_canonical_nan(c);
}

constexpr int kGemmBf16BM = 32, kGemmBf16BN = 32, kGemmBf16TM = 4, kGemmBf16TN = 4;
constexpr int kGemmBf16BK = (int)ls::kBf16FoldBlock;  // one staged k block is one block of the fold

// Block (bx, by) computes C rows [by*BM, +BM) x columns [bx*BN, +BN); thread
// (tx, ty) of a (BN/TN) x (BM/TM) block owns a TM x TN register tile.
// Reduces over k: per 32-k block, even k into E and odd k into O from +0,
// then C = (E + O) + C, as ls::bf16_dot.
__global__ void contract_gemm_bf16(int64_t M, int64_t N, int64_t K, Mat A, Mat B, float* C, int64_t ldc,
                                   bool accumulate) {
  __shared__ float As[kGemmBf16BM][kGemmBf16BK];
  __shared__ float Bs[kGemmBf16BK][kGemmBf16BN];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int threads = blockDim.x * blockDim.y, t = ty * blockDim.x + tx;
  const int64_t row0 = (int64_t)blockIdx.y * kGemmBf16BM, col0 = (int64_t)blockIdx.x * kGemmBf16BN;
  float acc[kGemmBf16TM][kGemmBf16TN];
  for (int i = 0; i < kGemmBf16TM; ++i)
    for (int j = 0; j < kGemmBf16TN; ++j) {
      const int64_t r = row0 + ty * kGemmBf16TM + i, c = col0 + tx * kGemmBf16TN + j;
      acc[i][j] = ls::bf16_flush(accumulate && r < M && c < N ? C[r * ldc + c] : 0.0f);  // the start, DAZ
    }
  for (int64_t k0 = 0; k0 < K; k0 += kGemmBf16BK) {
    const int kn = K - k0 < kGemmBf16BK ? (int)(K - k0) : kGemmBf16BK;
    // Stage the block, rounded and flushed once per element. Past K both
    // operands are +0: the fold's own padding (+0 * +0), not a shortcut.
    for (int e = t; e < kGemmBf16BM * kGemmBf16BK; e += threads) {
      const int i = e / kGemmBf16BK, kk = e % kGemmBf16BK;
      const int64_t r = row0 + i;
      As[i][kk] = r < M && kk < kn ? bf16_operand(A.p[r * A.rs + (k0 + kk) * A.cs]) : 0.0f;
    }
    for (int e = t; e < kGemmBf16BK * kGemmBf16BN; e += threads) {
      const int kk = e / kGemmBf16BN, j = e % kGemmBf16BN;
      const int64_t c = col0 + j;
      Bs[kk][j] = c < N && kk < kn ? bf16_operand(B.p[(k0 + kk) * B.rs + c * B.cs]) : 0.0f;
    }
    __syncthreads();
    float ev[kGemmBf16TM][kGemmBf16TN] = {}, od[kGemmBf16TM][kGemmBf16TN] = {};
    for (int kk = 0; kk < kGemmBf16BK; kk += 2)
      for (int i = 0; i < kGemmBf16TM; ++i)
        for (int j = 0; j < kGemmBf16TN; ++j) {
          const int r = ty * kGemmBf16TM + i, c = tx * kGemmBf16TN + j;
          ev[i][j] = ls::bf16_fold_step(ev[i][j], As[r][kk], Bs[kk][c]);
          od[i][j] = ls::bf16_fold_step(od[i][j], As[r][kk + 1], Bs[kk + 1][c]);
        }
    for (int i = 0; i < kGemmBf16TM; ++i)
      for (int j = 0; j < kGemmBf16TN; ++j) acc[i][j] = ls::bf16_add_step(ls::bf16_add_step(ev[i][j], od[i][j]), acc[i][j]);
    __syncthreads();
  }
  for (int i = 0; i < kGemmBf16TM; ++i)
    for (int j = 0; j < kGemmBf16TN; ++j) {
      const int64_t r = row0 + ty * kGemmBf16TM + i, c = col0 + tx * kGemmBf16TN + j;
      if (r >= M || c >= N) continue;
      if (K > 0) C[r * ldc + c] = ls::bf16_canonical_nan(acc[i][j]);
      else if (!accumulate) C[r * ldc + c] = 0.0f;  // K = 0: the start untouched (bf16_dot), +0 or C
    }
}

inline dim3 contract_gemm_bf16_grid(int64_t M, int64_t N) {
  return dim3((unsigned)((N + kGemmBf16BN - 1) / kGemmBf16BN), (unsigned)((M + kGemmBf16BM - 1) / kGemmBf16BM));
}
inline dim3 contract_gemm_bf16_block() { return dim3(kGemmBf16BN / kGemmBf16TN, kGemmBf16BM / kGemmBf16TM); }

}  // namespace ls::kernels
