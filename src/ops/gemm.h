// The contract GEMM: C = A·B (or C += A·B) where every output element is one
// sequential fma fold over k = 0..K-1, so its bits are those of the plain
// triple loop whatever the SIMD path, tiling or thread count.
#pragma once

#include <stdint.h>

namespace ls {
namespace ops {

// A read-only strided matrix view: element (r, c) is p[r*rs + c*cs].
// Transposed views are just swapped strides.
struct ConstMat {
  const float* p;
  int64_t rs;
  int64_t cs;
};

// C[i*ldc + j] = fold over k = 0..K-1 ascending of acc = fma(A(i,k), B(k,j), acc),
// acc starting at (accumulate ? C[i*ldc+j] : +0.0f).
// Reduces over k (the caller's logical index) sequentially: bits equal
// gemm_naive for any path and any thread count. K = 0 leaves C (accumulate)
// or zeroes it. threads = 0: omp_get_max_threads(), or 1 when called inside
// a parallel loop (common/parallel.h) or an OpenMP parallel region. Parallel
// only over output tiles, never over k.
void gemm(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc,
          bool accumulate, int threads = 0);

// The plain triple loop with ls::fma: the definition gemm must match, for tests.
void gemm_naive(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C,
                int64_t ldc, bool accumulate);

// Instruction-set path. kAuto picks the best the CPU supports; forcing a path
// the CPU lacks falls back to kAuto's choice. Process-wide; for tests/bench.
enum class GemmPath { kAuto, kScalar, kAvx2, kAvx512 };
void set_gemm_path(GemmPath path);
const char* gemm_path_name();  // "scalar", "avx2" or "avx512": the path in use
const char* path_name(GemmPath path);  // "scalar", "avx2", "avx512" (kAuto: "auto")
GemmPath gemm_path();          // the path in use (also picks the attention kernels)
bool gemm_path_supported(GemmPath path);
// The best path this CPU supports (probed once); the default of every
// dispatching op (GEMM, vectorized math).
GemmPath best_cpu_path();

}  // namespace ops
}  // namespace ls
