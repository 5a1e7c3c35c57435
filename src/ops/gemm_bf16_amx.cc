// AMX micro-kernel of the bf16 GEMM (this file alone is built with
// -mamx-tile -mamx-bf16; picked at run time when the CPU has AMX-BF16 and
// the kernel granted this process the tile state, gemm_bf16.cc). TDPBF16PS
// is the contract's bf16 fold in hardware: per output and tile op (one 32-k
// block) it folds the even and the odd products into two fp32 accumulators
// from +0, adds them, and adds that to C, every step rounded once with
// denormals flushed in and out (contract_bf16.h; tests/test_gemm_bf16.cc
// holds it to ls::bf16_dot). Operands come packed (gemm_bf16.cc): A strip
// uint32[kp/16][32][16], B panel uint32[kp][32], uint32 = a bf16 pair.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <atomic>

namespace ls {
namespace ops {
namespace internal {

namespace {

// Every tile 16 rows x 64 bytes: C tiles 0-3 (2 x 2 of 16 x 16 fp32), A
// tiles 4-5 (16 rows x 16 pairs), B tiles 6-7 (16 pair rows x 16 columns).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  uint8_t reserved2[16] = {};
};

// Bumped by amx_tiles_clobbered (gemm_bf16.h): another library's AMX
// kernels ran and may have reconfigured or released some thread's tiles.
std::atomic<uint32_t> tile_generation{0};

// The tile configuration is per thread state: loaded on each thread that
// runs the kernel, and again after another library's AMX kernels ran
// (oneDNN's at numerics.level=local release the tiles when they finish).
inline void configure_tiles() {
  static thread_local uint32_t loaded = ~0u;
  const uint32_t now = tile_generation.load(std::memory_order_acquire);
  if (loaded == now) return;
  static const TileConfig config;
  _tile_loadconfig(&config);
  loaded = now;
}

// A NaN stored as the fold's canonical one (hardware passes payloads on and
// makes 0xffc00000 for invalid operations).
inline void canonicalize(float* c, int64_t ldc) {
  const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000));
  for (int r = 0; r < 32; ++r)
    for (int v = 0; v < 2; ++v) {
      const __m512 x = _mm512_loadu_ps(c + r * ldc + 16 * v);
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      if (nan) _mm512_storeu_ps(c + r * ldc + 16 * v, _mm512_mask_mov_ps(x, nan, qnan));
    }
}

}  // namespace

void amx_tiles_clobbered() { tile_generation.fetch_add(1, std::memory_order_release); }

// 32 x 32 tile of C as 2 x 2 C tiles, one TDPBF16PS per C tile per 32-k
// block; C loaded as is when `load` (the hardware flushes a subnormal C).
void gemm_bf16_ukernel_amx_32x32(int64_t kp, const void* av, const void* bv, float* c, int64_t ldc, bool load) {
  const uint32_t* a = static_cast<const uint32_t*>(av);
  const uint32_t* b = static_cast<const uint32_t*>(bv);
  const int64_t cs = ldc * static_cast<int64_t>(sizeof(float));
  configure_tiles();
  if (load) {
    _tile_loadd(0, c, cs);
    _tile_loadd(1, c + 16, cs);
    _tile_loadd(2, c + 16 * ldc, cs);
    _tile_loadd(3, c + 16 * ldc + 16, cs);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j = 0; j < kp; j += 16) {
    const uint32_t* ab = a + j * 32;  // this block's 32 rows x 16 pairs
    const uint32_t* bb = b + j * 32;  // this block's 16 pair rows x 32 columns
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab + 16 * 16, 64);
    _tile_loadd(6, bb, 128);
    _tile_loadd(7, bb + 16, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, cs);
  _tile_stored(1, c + 16, cs);
  _tile_stored(2, c + 16 * ldc, cs);
  _tile_stored(3, c + 16 * ldc + 16, cs);
  canonicalize(c, ldc);
}

// ------------------------------------------------------------- packing ----
// The AMX path's packing of full strips and panels, 16 lanes at a time:
// packing, not TDPBF16PS, bounds this GEMM (every call packs both operands).

namespace {

// Shifts of all 16 lanes. (The zero-masked forms: gcc 12 warns that the plain
// ones' undefined pass-through may be used uninitialized.)
inline __m512i shr16(__m512i x) { return _mm512_maskz_srli_epi32(0xffff, x, 16); }
inline __m512i shl16(__m512i x) { return _mm512_maskz_slli_epi32(0xffff, x, 16); }

// Each lane's bf16 (ls::to_bf16: round to nearest even, a NaN kept quiet) in
// its high 16 bits; the low 16 bits are left over.
inline __m512i bf16_high(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(shr16(u), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x00400000));
}
inline __m512i bf16_high(const float* p) { return bf16_high(_mm512_loadu_ps(p)); }
inline __m512i bf16_high(const uint16_t* p) {
  return shl16(_mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

// 32 consecutive elements as 16 pairs, one uint32 each (k = 2j low, 2j+1
// high): the high 16 bits of the 32 lanes of two vectors, in order.
template <class T>
inline __m512i pairs_of_run(const T* p) {
  const __m512i high_halves = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                               27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(bf16_high(p), high_halves, bf16_high(p + 16));
}

// 16 pairs of two rows, column by column (row0's element low, row1's high).
template <class T>
inline __m512i pairs_of_rows(const T* row0, const T* row1) {
  return _mm512_or_si512(shr16(bf16_high(row0)),
                         _mm512_and_si512(bf16_high(row1), _mm512_set1_epi32(int(0xffff0000u))));
}

// A strip: 32 rows (row r at src + r*rs, k contiguous) x kp pairs, as
// uint32[kp/16][32][16] (one 16-row tile per half).
template <class T>
void pack_a_rows(const T* src, int64_t rs, int64_t kp, uint32_t* dst) {
  for (int64_t jb = 0; jb < kp / 16; ++jb)
    for (int r = 0; r < 32; ++r)
      _mm512_storeu_si512(dst + (jb * 32 + r) * 16, pairs_of_run(src + r * rs + jb * 32));
}

// B panel: 32 columns, B row k at src + k*rs (columns contiguous), as VNNI
// rows uint32[kp][32].
template <class T>
void pack_b_rows(const T* src, int64_t rs, int64_t kp, uint32_t* dst) {
  for (int64_t j = 0; j < kp; ++j) {
    const T* lo = src + 2 * j * rs;
    _mm512_storeu_si512(dst + j * 32, pairs_of_rows(lo, lo + rs));
    _mm512_storeu_si512(dst + j * 32 + 16, pairs_of_rows(lo + 16, lo + rs + 16));
  }
}

// B panel of a transposed view: column l's k run contiguous at src + l*cs.
template <class T>
void pack_b_columns(const T* src, int64_t cs, int64_t kp, uint32_t* dst) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(32));
  for (int64_t jb = 0; jb < kp / 16; ++jb)
    for (int l = 0; l < 32; ++l)
      _mm512_i32scatter_epi32(dst + jb * 16 * 32 + l, rows, pairs_of_run(src + l * cs + jb * 32), 4);
}

// A weight gradient's operand, both X and dY having the token index k in
// their rows: row k's first `lines` elements (at src + k*rs), the rest of
// 32 and the rows past `rows` +0 (the fold's padding), 16 lanes per half.
inline __m512i pairs_of_token_rows(const float* src, int64_t rs, int64_t rows, int lines, int64_t k, int half) {
  const __mmask16 m = lines >= 16 * (half + 1) ? 0xffff : lines <= 16 * half ? 0 : __mmask16((1u << (lines - 16 * half)) - 1);
  const __mmask16 m0 = k < rows ? m : 0, m1 = k + 1 < rows ? m : 0;
  const __m512i lo = bf16_high(_mm512_maskz_loadu_ps(m0, src + k * rs + 16 * half));
  const __m512i hi = bf16_high(_mm512_maskz_loadu_ps(m1, src + (k + 1) * rs + 16 * half));
  return _mm512_or_si512(shr16(lo), _mm512_and_si512(hi, _mm512_set1_epi32(int(0xffff0000u))));
}

}  // namespace

void amx_pack_token_a(const float* src, int64_t rs, int64_t rows, int lines, int64_t kp, uint32_t* dst) {
  // Line l (a feature of X) is A's row: its pair j lands at [j/16][l][j%16].
  const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                        _mm512_set1_epi32(16));
  for (int64_t j = 0; j < kp; ++j)
    for (int h = 0; h < 2; ++h)
      _mm512_i32scatter_epi32(dst + ((j >> 4) * 32 + 16 * h) * 16 + (j & 15), at,
                              pairs_of_token_rows(src, rs, rows, lines, 2 * j, h), 4);
}

void amx_pack_token_b(const float* src, int64_t rs, int64_t rows, int lines, int64_t kp, uint32_t* dst) {
  for (int64_t j = 0; j < kp; ++j)
    for (int h = 0; h < 2; ++h) _mm512_storeu_si512(dst + j * 32 + 16 * h, pairs_of_token_rows(src, rs, rows, lines, 2 * j, h));
}

void weight_grad_bf16_amx_32x32(const void* av, const void* bv, const int64_t* leaf_kp, int64_t leaves,
                                const int* merges, float* stack, float* c, int64_t ldc, bool load) {
  const uint32_t* a = static_cast<const uint32_t*>(av);
  const uint32_t* b = static_cast<const uint32_t*>(bv);
  constexpr int kTile = 32 * 32;
  configure_tiles();
  int depth = 0;
  for (int64_t l = 0; l < leaves; ++l) {
    float* top = stack + (int64_t)depth * kTile;
    if (load) {  // a continued fold (one leaf): from C, which the hardware flushes
      for (int r = 0; r < 32; ++r) memcpy(top + r * 32, c + r * ldc, 32 * sizeof(float));
      _tile_loadd(0, top, 128);
      _tile_loadd(1, top + 16, 128);
      _tile_loadd(2, top + 16 * 32, 128);
      _tile_loadd(3, top + 16 * 32 + 16, 128);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t j = leaf_kp[l]; j < leaf_kp[l + 1]; j += 16) {
      _tile_loadd(4, a + j * 32, 64);
      _tile_loadd(5, a + j * 32 + 16 * 16, 64);
      _tile_loadd(6, b + j * 32, 128);
      _tile_loadd(7, b + j * 32 + 16, 128);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, top, 128);
    _tile_stored(1, top + 16, 128);
    _tile_stored(2, top + 16 * 32, 128);
    _tile_stored(3, top + 16 * 32 + 16, 128);
    canonicalize(top, 32);
    // Push the leaf (LeafTree::push): left = left + right, as many times as the canonical tree says.
    for (int m = merges[l]; m > 0; --m, --depth) {
      float* left = stack + (int64_t)(depth - 1) * kTile;
      const float* right = left + kTile;
      for (int v = 0; v < kTile; v += 16)
        _mm512_store_ps(left + v, _mm512_add_ps(_mm512_load_ps(left + v), _mm512_load_ps(right + v)));
    }
    ++depth;
  }
  // LeafTree::finish: the stack folded right to left; no leaves give +0.
  if (depth == 0) memset(stack, 0, kTile * sizeof(float));
  for (int d = depth - 2; d >= 0; --d) {
    float* left = stack + (int64_t)d * kTile;
    for (int v = 0; v < kTile; v += 16)
      _mm512_store_ps(left + v, _mm512_add_ps(_mm512_load_ps(left + v), _mm512_load_ps(left + kTile + v)));
  }
  for (int r = 0; r < 32; ++r) memcpy(c + r * ldc, stack + r * 32, 32 * sizeof(float));
}

void amx_pack_a(const float* src, int64_t rs, int64_t kp, uint32_t* dst) { pack_a_rows(src, rs, kp, dst); }
void amx_pack_a(const uint16_t* src, int64_t rs, int64_t kp, uint32_t* dst) { pack_a_rows(src, rs, kp, dst); }
void amx_pack_b(const float* src, int64_t rs, int64_t kp, uint32_t* dst) { pack_b_rows(src, rs, kp, dst); }
void amx_pack_b(const uint16_t* src, int64_t rs, int64_t kp, uint32_t* dst) { pack_b_rows(src, rs, kp, dst); }
void amx_pack_bt(const float* src, int64_t cs, int64_t kp, uint32_t* dst) { pack_b_columns(src, cs, kp, dst); }
void amx_pack_bt(const uint16_t* src, int64_t cs, int64_t kp, uint32_t* dst) {
  pack_b_columns(src, cs, kp, dst);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
