// 8 x 8 float transposes in AVX registers, shared by the GEMM's packing, the
// attention kernels' query blocks and the folds that run eight rows side by
// side in vector lanes. Pure data movement.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace ls::ops {

// out[i] lane j = in[j] lane i.
inline void transpose8(const __m256 in[8], __m256 out[8]) {
  __m256 t0 = _mm256_unpacklo_ps(in[0], in[1]), t1 = _mm256_unpackhi_ps(in[0], in[1]);
  __m256 t2 = _mm256_unpacklo_ps(in[2], in[3]), t3 = _mm256_unpackhi_ps(in[2], in[3]);
  __m256 t4 = _mm256_unpacklo_ps(in[4], in[5]), t5 = _mm256_unpackhi_ps(in[4], in[5]);
  __m256 t6 = _mm256_unpacklo_ps(in[6], in[7]), t7 = _mm256_unpackhi_ps(in[6], in[7]);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  out[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  out[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  out[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  out[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  out[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  out[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  out[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  out[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// out[c] lane r = rows[r][off + c] for r, c < 8: eight features of eight rows,
// a feature per register, a row per lane.
inline void columns8(const float* const rows[8], int64_t off, __m256 out[8]) {
  __m256 in[8];
  for (int r = 0; r < 8; ++r) in[r] = _mm256_loadu_ps(rows[r] + off);
  transpose8(in, out);
}

// dst[i*ds + j] = src[j*ss + i] for i, j < 8.
inline void transpose8x8(const float* src, int64_t ss, float* dst, int64_t ds) {
  __m256 in[8], out[8];
  for (int r = 0; r < 8; ++r) in[r] = _mm256_loadu_ps(src + r * ss);
  transpose8(in, out);
  for (int r = 0; r < 8; ++r) _mm256_storeu_ps(dst + r * ds, out[r]);
}

}  // namespace ls::ops
