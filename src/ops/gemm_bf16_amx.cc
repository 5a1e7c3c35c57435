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

// The tile configuration is per thread state: loaded once on each thread
// that runs the kernel (nothing else in the process configures tiles).
inline void configure_tiles() {
  static thread_local bool configured = false;
  if (configured) return;
  static const TileConfig config;
  _tile_loadconfig(&config);
  configured = true;
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

}  // namespace internal
}  // namespace ops
}  // namespace ls
