// AVX-512 micro-kernel of the contract GEMM (built with -mavx512f and picked
// at run time). One 16-lane fma per (row, 16 columns, k): each lane is its
// own C element's sequential fold, so the bits equal the scalar loop.
#include <immintrin.h>
#include <stdint.h>

namespace ls {
namespace ops {
namespace internal {

// C tile (MR x 16*NV) gets the fold of A strip (element (r,k) at
// a[r*ars + k*acs]) times B panel (kc x 16*NV, row k at b + k*ldb: packed, or
// read in place). Reduces over
// k sequentially, in registers; `load` = start from C, else from +0.
template <int MR, int NV>
static void ukernel(int64_t kc, const float* a, int64_t ars, int64_t acs, const float* b,
                    int64_t ldb, float* c, int64_t ldc, bool load) {
  __m512 acc[MR][NV];
  if (load) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(c + r * ldc + 16 * v);
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      __m512 ar = _mm512_set1_ps(a[r * ars]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
    a += acs;
    b += ldb;
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}

// 8 x 32: 16 zmm accumulators (enough independent chains to hide fma
// latency on two pipes), 2 B loads + 8 broadcasts per k. 8 and 32 divide the
// engine's usual row and column counts, so few tiles take the edge path.
void gemm_ukernel_avx512_8x32(int64_t kc, const float* a, int64_t ars, int64_t acs,
                              const float* b, int64_t ldb, float* c, int64_t ldc, bool load) {
  ukernel<8, 2>(kc, a, ars, acs, b, ldb, c, ldc, load);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
