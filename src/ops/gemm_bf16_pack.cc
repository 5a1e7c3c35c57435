// The bf16 GEMM's packing (gemm_bf16_pack.h): each form's layout is
// described where gemm_bf16.cc lists the forms.
#include "ops/gemm_bf16_pack.h"

#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "numerics/contract.h"
#include "ops/bf16_round8.h"

namespace ls::ops::internal {

// The amx path's packing of a full strip or panel (kp a multiple of 16):
// A rows k-contiguous; B rows column-contiguous (amx_pack_b) or columns
// k-contiguous (amx_pack_bt, a transposed view).
void amx_pack_a(const float* src, int64_t rs, int64_t kp, uint32_t* dst);
void amx_pack_a(const uint16_t* src, int64_t rs, int64_t kp, uint32_t* dst);
void amx_pack_b(const float* src, int64_t rs, int64_t kp, uint32_t* dst);
void amx_pack_b(const uint16_t* src, int64_t rs, int64_t kp, uint32_t* dst);
void amx_pack_bt(const float* src, int64_t cs, int64_t kp, uint32_t* dst);
void amx_pack_bt(const uint16_t* src, int64_t cs, int64_t kp, uint32_t* dst);

namespace {

// Where packing reads an operand's bf16: stored bits (ConstMatBf16), or
// fp32 values rounded (ls::to_bf16) as they are read (ConstMat): the same
// bits as rounding the whole operand first, without a copy of it.
inline uint16_t bf16_at(const ConstMatBf16& m, int64_t off) { return m.p[off]; }
inline uint16_t bf16_at(const ConstMat& m, int64_t off) { return ls::to_bf16(m.p[off]); }

// One pair (k = 2j in lo, 2j+1 in hi) into line l of a packed operand of
// `width` lines: two flushed fp32 rows (k = 2j, 2j+1), or one uint32: for
// A (a_side) in tile rows of 16 pairs, for B in VNNI rows of all columns.
inline void put_pair(bool tiles, bool a_side, int width, int64_t j, int l, uint16_t lo, uint16_t hi,
                     uint32_t* dst) {
  if (tiles) {
    const int64_t at = a_side ? ((j >> 4) * width + l) * 16 + (j & 15) : j * width + l;
    dst[at] = uint32_t(lo) | uint32_t(hi) << 16;
  } else {
    float* f = reinterpret_cast<float*>(dst);
    f[(2 * j) * width + l] = ls::bf16_in(lo);
    f[(2 * j + 1) * width + l] = ls::bf16_in(hi);
  }
}

// One operand tile into its packed form: `width` lines (rows of A, columns
// of B) of kp pairs from k0; line l of the operand is its element (l0 + l, k)
// through get(l, k), +0 past `lines` or past K.
template <class Get>
void pack_tile(bool tiles, bool a_side, int width, int64_t lines, int64_t kp, int64_t k0, int64_t K, Get get,
               uint32_t* dst) {
  for (int64_t j = 0; j < kp; ++j) {
    const int64_t k = k0 + 2 * j;
    for (int l = 0; l < width; ++l) {
      const uint16_t lo = l < lines && k < K ? get(l, k) : uint16_t(0);
      const uint16_t hi = l < lines && k + 1 < K ? get(l, k + 1) : uint16_t(0);
      put_pair(tiles, a_side, width, j, l, lo, hi, dst);
    }
  }
}

// The pairs form (avx512-bf16): `width` lines, kp pair rows from k0 (a
// multiple of 32), pair row 16b + 8h + p of fold block b holding k = k0 +
// 32b + 4p + h in its high half and that k + 2 in its low half; +0 past
// `lines` or past K. Element (l, k) of the operand is m at base + l * ls +
// k * ks.
inline int64_t pair_first_k(int64_t k0, int64_t pr) { return k0 + 32 * (pr >> 4) + 4 * (pr & 7) + (pr >> 3 & 1); }

// Asks for n floats from p in cache, a line at a time.
inline void prefetch_floats(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// pack_pairs of fp32 lines whose k lie side by side (ks = 1, every k of the
// range below K): per line, a fold block's 32 k rounded eight at a time; in
// each eight, lanes 0 and 4 start E pairs and lanes 1 and 5 O pairs, whose
// second k is two lanes on.
void pack_pairs_k_contiguous(const float* p, int64_t ls, int width, int64_t lines, int64_t kp, uint32_t* dst) {
  const __m256i two_on = _mm256_setr_epi32(2, 3, 4, 5, 6, 7, 0, 0);
  prefetch_floats(p, 2 * kp);
  for (int64_t l = 0; l < lines; ++l) {
    const float* x = p + l * ls;
    if (l + 1 < lines) prefetch_floats(x + ls, 2 * kp);  // short runs of many lines: the hardware is late on them
    for (int64_t b = 0; b < kp / 16; ++b)
      for (int i = 0; i < 4; ++i) {
        const __m256i v = bf16_round8_high(_mm256_loadu_si256((const __m256i*)(x + 32 * b + 8 * i)));
        const __m256i t = _mm256_or_si256(v, _mm256_srli_epi32(_mm256_permutevar8x32_epi32(v, two_on), 16));
        uint32_t* e = dst + (16 * b + 2 * i) * width + l;
        e[0] = (uint32_t)_mm256_extract_epi32(t, 0);
        e[width] = (uint32_t)_mm256_extract_epi32(t, 4);
        e[8 * width] = (uint32_t)_mm256_extract_epi32(t, 1);
        e[9 * width] = (uint32_t)_mm256_extract_epi32(t, 5);
      }
  }
  for (int64_t pr = 0; pr < kp; ++pr)
    for (int64_t l = lines; l < width; ++l) dst[pr * width + l] = 0;
}

// Pair row pr of pack_pairs (below) into `row`.
template <class Mat>
void pack_pair_row(const Mat& m, int64_t base, int64_t ls, int64_t ks, int width, int64_t lines, int64_t pr,
                   int64_t k0, int64_t K, uint32_t* row) {
  const int64_t first = pair_first_k(k0, pr), second = first + 2;
  int l = 0;
  if constexpr (std::is_same_v<Mat, ConstMat>) {
    if (ls == 1 && second < K)  // lines side by side: eight at a time
      for (; l + 8 <= lines; l += 8) {
        const __m256i hi = bf16_round8_high(_mm256_loadu_si256((const __m256i*)(m.p + base + first * ks + l)));
        const __m256i lo = bf16_round8_high(_mm256_loadu_si256((const __m256i*)(m.p + base + second * ks + l)));
        _mm256_storeu_si256((__m256i*)(row + l), _mm256_or_si256(hi, _mm256_srli_epi32(lo, 16)));
      }
  }
  for (; l < width; ++l) {
    const uint16_t hi = l < lines && first < K ? bf16_at(m, base + l * ls + first * ks) : uint16_t(0);
    const uint16_t lo = l < lines && second < K ? bf16_at(m, base + l * ls + second * ks) : uint16_t(0);
    row[l] = uint32_t(lo) | uint32_t(hi) << 16;
  }
}

template <class Mat>
void pack_pairs(const Mat& m, int64_t base, int64_t ls, int64_t ks, int width, int64_t lines, int64_t kp, int64_t k0,
                int64_t K, uint32_t* dst) {
  if constexpr (std::is_same_v<Mat, ConstMat>) {
    if (ks == 1 && k0 + 2 * kp <= K) return pack_pairs_k_contiguous(m.p + base + k0, ls, width, lines, kp, dst);
  }
  for (int64_t pr = 0; pr < kp; ++pr) pack_pair_row(m, base, ls, ks, width, lines, pr, k0, K, dst + pr * width);
}

}  // namespace

template <class Mat>
void pack_a(const Mat& A, int64_t i0, int64_t mv, const Bf16Kernel& uk, int64_t k0, int64_t kp, int64_t K,
            uint32_t* dst) {
  const int64_t base = i0 * A.rs;
  const bool full = mv == uk.mr && k0 + 2 * kp <= K;
  if (uk.form == Packed::kPairs)
    return pack_pairs(A, base, A.rs, A.cs, uk.mr, mv, kp, k0, K, dst);
  if (uk.tiles() && full && A.cs == 1) return amx_pack_a(A.p + base + k0, A.rs, kp, dst);
  if (A.cs == 1 && full) {  // row-major, full strip: rows read in order
    for (int r = 0; r < uk.mr; ++r) {
      const int64_t row = base + r * A.rs + k0;
      for (int64_t j = 0; j < kp; ++j)
        put_pair(uk.tiles(), true, uk.mr, j, r, bf16_at(A, row + 2 * j), bf16_at(A, row + 2 * j + 1), dst);
    }
    return;
  }
  pack_tile(uk.tiles(), true, uk.mr, mv, kp, k0, K,
            [&](int l, int64_t k) { return bf16_at(A, base + l * A.rs + k * A.cs); }, dst);
}

template <class Mat>
void pack_b(const Mat& B, int64_t j0, int64_t nv, const Bf16Kernel& uk, int64_t k0, int64_t kp, int64_t K,
            uint32_t* dst) {
  const int64_t base = j0 * B.cs;
  const bool full = nv == uk.nr && k0 + 2 * kp <= K;
  if (uk.form == Packed::kPairs)
    return pack_pairs(B, base, B.cs, B.rs, uk.nr, nv, kp, k0, K, dst);
  if (uk.tiles() && full && B.cs == 1) return amx_pack_b(B.p + base + k0 * B.rs, B.rs, kp, dst);
  if (uk.tiles() && full && B.rs == 1) return amx_pack_bt(B.p + base + k0, B.cs, kp, dst);
  if (B.cs == 1 && full) {  // row-major, full panel: two rows interleaved
    for (int64_t j = 0; j < kp; ++j) {
      const int64_t lo = base + (k0 + 2 * j) * B.rs, hi = lo + B.rs;
      for (int l = 0; l < uk.nr; ++l)
        put_pair(uk.tiles(), false, uk.nr, j, l, bf16_at(B, lo + l), bf16_at(B, hi + l), dst);
    }
    return;
  }
  pack_tile(uk.tiles(), false, uk.nr, nv, kp, k0, K,
            [&](int l, int64_t k) { return bf16_at(B, base + k * B.rs + l * B.cs); }, dst);
}

template <class Mat>
void pack_b_panels(const Mat& B, int64_t N, int64_t p0, int64_t p1, const Bf16Kernel& uk, int64_t k0, int64_t kp,
                   int64_t K, uint32_t* bpack) {
  const int NR = uk.nr;
  auto nv = [&](int64_t p) { return std::min<int64_t>(NR, N - p * NR); };
  if (uk.form != Packed::kPairs || B.cs != 1) {
    const int64_t wpp = uk.form != Packed::kFp32 ? 1 : 2;  // words per packed k pair of one line
    for (int64_t p = p0; p < p1; ++p) pack_b(B, p * NR, nv(p), uk, k0, kp, K, bpack + p * kp * wpp * NR);
    return;
  }
  for (int64_t pr = 0; pr < kp; ++pr) {
    if constexpr (std::is_same_v<Mat, ConstMat>)  // the next pair row's two rows of these panels
      if (pr + 1 < kp)
        for (int64_t k : {pair_first_k(k0, pr + 1), pair_first_k(k0, pr + 1) + 2})
          if (k < K) prefetch_floats(B.p + k * B.rs + p0 * NR, std::min(N, p1 * NR) - p0 * NR);
    for (int64_t p = p0; p < p1; ++p)
      pack_pair_row(B, p * NR, B.cs, B.rs, NR, nv(p), pr, k0, K, bpack + p * kp * NR + pr * NR);
  }
}

int packed_min_exponent(const uint32_t* w, int64_t n) {
  const __m256i field = _mm256_set1_epi32(0xff), none = _mm256_set1_epi32(255), zero = _mm256_setzero_si256();
  __m256i m = none;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)(w + i));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(x, 23), field), lo = _mm256_and_si256(_mm256_srli_epi32(x, 7), field);
    m = _mm256_min_epu32(m, _mm256_blendv_epi8(hi, none, _mm256_cmpeq_epi32(hi, zero)));
    m = _mm256_min_epu32(m, _mm256_blendv_epi8(lo, none, _mm256_cmpeq_epi32(lo, zero)));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256((__m256i*)lanes, m);
  return (int)*std::min_element(lanes, lanes + 8);
}

template void pack_a(const ConstMat&, int64_t, int64_t, const Bf16Kernel&, int64_t, int64_t, int64_t, uint32_t*);
template void pack_a(const ConstMatBf16&, int64_t, int64_t, const Bf16Kernel&, int64_t, int64_t, int64_t, uint32_t*);
template void pack_b(const ConstMat&, int64_t, int64_t, const Bf16Kernel&, int64_t, int64_t, int64_t, uint32_t*);
template void pack_b(const ConstMatBf16&, int64_t, int64_t, const Bf16Kernel&, int64_t, int64_t, int64_t, uint32_t*);
template void pack_b_panels(const ConstMat&, int64_t, int64_t, int64_t, const Bf16Kernel&, int64_t, int64_t, int64_t,
                            uint32_t*);
template void pack_b_panels(const ConstMatBf16&, int64_t, int64_t, int64_t, const Bf16Kernel&, int64_t, int64_t,
                            int64_t, uint32_t*);

}  // namespace ls::ops::internal
