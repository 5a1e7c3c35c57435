// The contract GEMM as a CUDA kernel: C = A·B (or C += A·B) where every output
// element is one sequential fma fold over k = 0..K-1, the bits of
// ops::gemm_naive. Reduces over k, in order: a thread keeps a TM x TN tile of
// C in registers across the whole k loop; shared memory only stages the
// operands, BK values of k at a time. Compiled by nvcc (-fmad=false) and, for
// the checks without a GPU, by g++ against kernels/emu/cuda_emu.h.
#pragma once

#include <cstdint>

#include "contract.h"

namespace ls::kernels {

// A read-only strided matrix: element (r, c) is p[r*rs + c*cs] (ops::ConstMat).
struct Mat {
  const float* p;
  int64_t rs, cs;
};

constexpr int kGemmBM = 32, kGemmBN = 32, kGemmBK = 16, kGemmTM = 4, kGemmTN = 4;

// Block (bx, by) computes C rows [by*BM, +BM) x columns [bx*BN, +BN); thread
// (tx, ty) of a (BN/TN) x (BM/TM) block owns a TM x TN register tile.
__global__ void contract_gemm(int64_t M, int64_t N, int64_t K, Mat A, Mat B, float* C, int64_t ldc, bool accumulate) {
  __shared__ float As[kGemmBM][kGemmBK];
  __shared__ float Bs[kGemmBK][kGemmBN];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int threads = blockDim.x * blockDim.y, t = ty * blockDim.x + tx;
  const int64_t row0 = (int64_t)blockIdx.y * kGemmBM, col0 = (int64_t)blockIdx.x * kGemmBN;
  float acc[kGemmTM][kGemmTN];
  for (int i = 0; i < kGemmTM; ++i)
    for (int j = 0; j < kGemmTN; ++j) {
      const int64_t r = row0 + ty * kGemmTM + i, c = col0 + tx * kGemmTN + j;
      acc[i][j] = accumulate && r < M && c < N ? C[r * ldc + c] : 0.0f;
    }
  for (int64_t k0 = 0; k0 < K; k0 += kGemmBK) {
    const int kn = K - k0 < kGemmBK ? (int)(K - k0) : kGemmBK;
    // Stage the operands (the block's threads share the loads).
    for (int e = t; e < kGemmBM * kGemmBK; e += threads) {
      const int i = e / kGemmBK, kk = e % kGemmBK;
      const int64_t r = row0 + i;
      As[i][kk] = r < M && kk < kn ? A.p[r * A.rs + (k0 + kk) * A.cs] : 0.0f;
    }
    for (int e = t; e < kGemmBK * kGemmBN; e += threads) {
      const int kk = e / kGemmBN, j = e % kGemmBN;
      const int64_t c = col0 + j;
      Bs[kk][j] = c < N && kk < kn ? B.p[(k0 + kk) * B.rs + c * B.cs] : 0.0f;
    }
    __syncthreads();
    // k in order: only the kn real values (a zero pad would add 0*b, which is not +0 for an infinite b).
    for (int kk = 0; kk < kn; ++kk)
      for (int i = 0; i < kGemmTM; ++i)
        for (int j = 0; j < kGemmTN; ++j)
          acc[i][j] = ls::fma(As[ty * kGemmTM + i][kk], Bs[kk][tx * kGemmTN + j], acc[i][j]);
    __syncthreads();
  }
  for (int i = 0; i < kGemmTM; ++i)
    for (int j = 0; j < kGemmTN; ++j) {
      const int64_t r = row0 + ty * kGemmTM + i, c = col0 + tx * kGemmTN + j;
      if (r < M && c < N) C[r * ldc + c] = acc[i][j];
    }
}

inline dim3 contract_gemm_grid(int64_t M, int64_t N) {
  return dim3((unsigned)((N + kGemmBN - 1) / kGemmBN), (unsigned)((M + kGemmBM - 1) / kGemmBM));
}
inline dim3 contract_gemm_block() { return dim3(kGemmBN / kGemmTN, kGemmBM / kGemmTM); }

}  // namespace ls::kernels
