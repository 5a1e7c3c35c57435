// Contract bf16 GEMM: the fp32 GEMM's blocking (gemm.cc) with both operands
// packed, since every path wants them in another form than they lie in.
//
// Loop nest: k blocks of KC (a multiple of 32, the fold's block, so no
// block straddles two; the last block of K is padded with +0 k up to a
// multiple of 32, the fold's own padding); B packed into column panels of
// NR, A into strips of MR rows per row block of MC; a micro-kernel per
// MR x NR tile of C. Between k blocks the fp32 partial sums are stored to C
// and reloaded: a flushed binary32 stored and reloaded is the same value,
// and a fold continued after a multiple of 32 k is the one fold. Threads
// split output tiles only.
//
// Packed forms (kp = pairs in the block, a multiple of 16; padding rows,
// columns and k are +0):
//   tiles (amx): A strip uint32[kp/16][MR][16] (each row of a 16-pair block
//     64 bytes: a tile row), B panel uint32[kp][NR] (VNNI: pair row j of
//     all columns), each uint32 the bf16 of k = 2j in its low half and of
//     2j+1 in its high half: what TDPBF16PS multiplies;
//   pairs (avx512-bf16): A strip uint32[kp][MR], B panel uint32[kp][NR],
//     per 32-k block from k0 16 pair rows: E's 8 (row p: k0 + 4p in the high
//     half, k0 + 4p + 2 in the low), then O's 8 (k0 + 4p + 1, k0 + 4p + 3):
//     what vdpbf16ps folds, high half first (gemm_bf16_avx512bf16.cc);
//   fp32 (scalar, avx2, avx512): A strip float[2kp][MR], B panel
//     float[2kp][NR], every value ls::bf16_in (flushed): the kernels then
//     run ls::bf16_fold_step on each lane, per 32-k block the even k into E
//     and the odd k into O, then add E + O and C with ls::bf16_add_step.
// The packing itself: gemm_bf16_pack.cc. On avx512-bf16 each tile's packed
// strip and panel say, by their smallest exponents, whether vdpbf16ps gives
// the contract's bits (gemm_bf16.h); a tile for which it would not runs on
// the avx512 replay, packed again in its form.
#include "ops/gemm_bf16.h"

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <new>
#include <vector>

#include "common/thread_pool.h"
#include "numerics/contract.h"
#include "ops/aligned_scratch.h"
#include "ops/flush_to_zero.h"
#include "ops/gemm_bf16_pack.h"

namespace ls {
namespace ops {
namespace internal {

// gemm_bf16_avx512.cc (AVX-512 flags) and gemm_bf16_amx.cc (plus AMX):
// called only when the CPU (and, for AMX, the kernel) allows them.
void gemm_bf16_ukernel_avx512_8x32(int64_t kp, const void* a, const void* b, float* c, int64_t ldc, bool load);
void gemm_bf16_ukernel_amx_32x32(int64_t kp, const void* a, const void* b, float* c, int64_t ldc, bool load);
void gemm_bf16_ukernel_avx512bf16_8x32(int64_t kp, const void* a, const void* b, float* c, int64_t ldc, bool load);

// The contract step out of line, for the lanes the SIMD emulations hand
// back (a result of exactly +-2^-126), so no contract.h inline is compiled
// with AVX-512 flags.
float bf16_fold_step_out_of_line(float acc, float a, float b) { return ls::bf16_fold_step(acc, a, b); }

}  // namespace internal

namespace {

using internal::Bf16Kernel;
using internal::pack_a;
using internal::pack_b;
using internal::Packed;

// ------------------------------------------------------------ kernels ----

// Scalar: per 32-k block, ls::bf16_fold_step per (row, column, k) into E
// (even k) and O (odd k), then C = (E + O) + C with ls::bf16_add_step.
template <int MR, int NR>
void ukernel_scalar(int64_t kp, const void* av, const void* bv, float* c, int64_t ldc, bool load) {
  const float* a = static_cast<const float*>(av);
  const float* b = static_cast<const float*>(bv);
  float acc[MR][NR], e[MR][NR], o[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = load ? ls::bf16_flush(c[r * ldc + j]) : 0.0f;
  for (int64_t k0 = 0; k0 < 2 * kp; k0 += ls::kBf16FoldBlock) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) e[r][j] = o[r][j] = 0.0f;
    for (int64_t k = k0; k < k0 + ls::kBf16FoldBlock; k += 2)
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NR; ++j) {
          e[r][j] = ls::bf16_fold_step(e[r][j], a[k * MR + r], b[k * NR + j]);
          o[r][j] = ls::bf16_fold_step(o[r][j], a[(k + 1) * MR + r], b[(k + 1) * NR + j]);
        }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = ls::bf16_add_step(ls::bf16_add_step(e[r][j], o[r][j]), acc[r][j]);
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = ls::bf16_canonical_nan(acc[r][j]);
}

// AVX2 + FMA: one fold step on 8 lanes. The fma is the step; a result at or
// below 2^-126 in magnitude (rare in real data: zeros, padding) is flushed
// by a blend, and one of exactly 2^-126 redone by the contract's step.
inline __m256 abs8(__m256 x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }

__attribute__((noinline)) __m256 fix_tiny8(__m256 f, __m256 acc, __m256 a, __m256 b) {
  const __m256 minnorm = _mm256_set1_ps(0x1p-126f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  const __m256 lt = _mm256_cmp_ps(abs8(f), minnorm, _CMP_LT_OQ);
  const int eq = _mm256_movemask_ps(_mm256_cmp_ps(abs8(f), minnorm, _CMP_EQ_OQ));
  f = _mm256_blendv_ps(f, _mm256_and_ps(f, sign), lt);
  if (eq == 0) return f;
  alignas(32) float fv[8], accv[8], avv[8], bvv[8];
  _mm256_store_ps(fv, f);
  _mm256_store_ps(accv, acc);
  _mm256_store_ps(avv, a);
  _mm256_store_ps(bvv, b);
  for (int l = 0; l < 8; ++l)
    if (eq >> l & 1) fv[l] = ls::bf16_fold_step(accv[l], avv[l], bvv[l]);
  return _mm256_load_ps(fv);
}

inline __m256 step8(__m256 acc, __m256 a, __m256 b) {
  const __m256 f = _mm256_fmadd_ps(a, b, acc);
  if (_mm256_movemask_ps(_mm256_cmp_ps(abs8(f), _mm256_set1_ps(0x1p-126f), _CMP_LE_OQ)) == 0) return f;
  return fix_tiny8(f, acc, a, b);
}

inline __m256 flush8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(abs8(x), _mm256_set1_ps(0x1p-126f), _CMP_LT_OQ);
  return _mm256_blendv_ps(x, _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))), tiny);
}

inline __m256 canonical8(__m256 x) {
  return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// One accumulator run of a 32-k block for the AVX2 kernel: k = k0, k0 + 2,
// ... from +0, MR x 16 lanes.
template <int MR>
inline void fold_half8(const float* a, const float* b, int64_t k0, __m256 (&acc)[MR][2]) {
  constexpr int NR = 16;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = k0; k < (k0 & ~(kBf16FoldBlock - 1)) + kBf16FoldBlock; k += 2) {
    const float* ak = a + k * MR;
    const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(ak + r);
      acc[r][0] = step8(acc[r][0], ar, b0);
      acc[r][1] = step8(acc[r][1], ar, b1);
    }
  }
}

// 6 x 16 in 12 ymm accumulators, as the fp32 AVX2 kernel. Per 32-k block:
// the even k from +0, stashed as E; the odd k from +0 (O); then
// C = flush(flush(E + O) + C), C kept in a buffer across blocks.
void ukernel_avx2(int64_t kp, const void* av, const void* bv, float* c, int64_t ldc, bool load) {
  constexpr int MR = 6, NR = 16;
  const float* a = static_cast<const float*>(av);
  const float* b = static_cast<const float*>(bv);
  alignas(32) float cbuf[MR][NR], ebuf[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_store_ps(&cbuf[r][8 * h], load ? flush8(_mm256_loadu_ps(c + r * ldc + 8 * h)) : _mm256_setzero_ps());
  for (int64_t k0 = 0; k0 < 2 * kp; k0 += kBf16FoldBlock) {
    __m256 acc[MR][2];
    fold_half8<MR>(a, b, k0, acc);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) _mm256_store_ps(&ebuf[r][8 * h], acc[r][h]);
    fold_half8<MR>(a, b, k0 + 1, acc);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m256 s = flush8(_mm256_add_ps(_mm256_load_ps(&ebuf[r][8 * h]), acc[r][h]));
        _mm256_store_ps(&cbuf[r][8 * h], flush8(_mm256_add_ps(s, _mm256_load_ps(&cbuf[r][8 * h]))));
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + r * ldc + 8 * h, canonical8(_mm256_load_ps(&cbuf[r][8 * h])));
}

const Bf16Kernel kScalarKernel = {4, 8, Packed::kFp32, ukernel_scalar<4, 8>};
const Bf16Kernel kAvx2Kernel = {6, 16, Packed::kFp32, ukernel_avx2};
const Bf16Kernel kAvx512Kernel = {8, 32, Packed::kFp32, internal::gemm_bf16_ukernel_avx512_8x32};
const Bf16Kernel kAvx512Bf16Kernel = {8, 32, Packed::kPairs, internal::gemm_bf16_ukernel_avx512bf16_8x32};
const Bf16Kernel kAmxKernel = {32, 32, Packed::kTiles, internal::gemm_bf16_ukernel_amx_32x32};

// ------------------------------------------------------------ dispatch ----

std::atomic<int> g_forced{static_cast<int>(Bf16Path::kAuto)};
std::atomic<int64_t> g_tiny_fallbacks{0};

// AMX: the CPU's AMX-TILE and AMX-BF16 (cpuid 7.0 EDX bits 24, 22), the OS's
// tile state in XCR0 (bits 17, 18), and the kernel's permission for this
// process (Linux keeps tile data off until asked, per process). Asked once.
bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return false;  // OSXSAVE, for xgetbv
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1)) return false;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3u) != 3u) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

bool cpu_has(Bf16Path p) {
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (p) {
    case Bf16Path::kAuto:
    case Bf16Path::kScalar:
      return true;
    case Bf16Path::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Bf16Path::kAvx512:
      return avx512;
    case Bf16Path::kAvx512Bf16:
      return avx512 && __builtin_cpu_supports("avx512bf16");
    case Bf16Path::kAmx:
      return avx512 && amx_usable();
  }
  return false;
}

Bf16Path best_path() {
  static const Bf16Path best = cpu_has(Bf16Path::kAmx)          ? Bf16Path::kAmx
                               : cpu_has(Bf16Path::kAvx512Bf16) ? Bf16Path::kAvx512Bf16
                               : cpu_has(Bf16Path::kAvx512)     ? Bf16Path::kAvx512
                               : cpu_has(Bf16Path::kAvx2)     ? Bf16Path::kAvx2
                                                              : Bf16Path::kScalar;
  return best;
}

Bf16Path effective_path() {
  Bf16Path p = static_cast<Bf16Path>(g_forced.load(std::memory_order_relaxed));
  if (p != Bf16Path::kAuto && cpu_has(p)) return p;
  return best_path();
}

const Bf16Kernel& kernel_for(Bf16Path p) {
  switch (p) {
    case Bf16Path::kAmx:
      return kAmxKernel;
    case Bf16Path::kAvx512:
      return kAvx512Kernel;
    case Bf16Path::kAvx512Bf16:
      return kAvx512Bf16Kernel;
    case Bf16Path::kAvx2:
      return kAvx2Kernel;
    default:
      return kScalarKernel;
  }
}

// ------------------------------------------------------------- packing ----

// Grow-only 64-byte aligned scratch, one per thread.
using Scratch = AlignedScratch<uint32_t>;


// One micro-tile; partial tiles go through an MR x NR buffer so the kernel
// always sees a full tile (padding lanes are computed and dropped).
inline void run_tile(const Bf16Kernel& uk, int64_t kp, const uint32_t* a, const uint32_t* b, float* c,
                     int64_t ldc, int64_t mv, int64_t nv, bool load) {
  if (mv == uk.mr && nv == uk.nr) {
    uk.fn(kp, a, b, c, ldc, load);
    return;
  }
  alignas(64) float tile[16 * 64];  // >= every kernel's MR x NR
  if (load)
    for (int64_t r = 0; r < mv; ++r) memcpy(tile + r * uk.nr, c + r * ldc, sizeof(float) * nv);
  uk.fn(kp, a, b, tile, uk.nr, load);
  for (int64_t r = 0; r < mv; ++r) memcpy(c + r * ldc, tile + r * uk.nr, sizeof(float) * nv);
}

// k block (a multiple of the fold's 32): a packed B panel of 32 KB stays in
// L1, as the fp32 GEMM's (256 k x 32 fp32): 512 k as bf16 pairs, 256 k as
// replayed fp32.
constexpr int64_t kKCPairs = 512, kKCFp32 = 256;
static_assert(kKCPairs % kBf16FoldBlock == 0 && kKCFp32 % kBf16FoldBlock == 0, "k blocks hold whole fold blocks");
constexpr int64_t kMC = 192;  // rows per A block (rounded to MR)


// Whether vdpbf16ps gives the contract's bits for a tile whose A strip and B
// panel have these smallest exponents (gemm_bf16.h): every product then a
// multiple of 2^-149, its last bit being 14 places below its exponents' sum.
bool vdpbf16ps_exact(int a_exp, int b_exp) { return a_exp + b_exp - 2 * 127 >= -135; }

// A tile the avx512-bf16 path cannot take, on the avx512 replay: its strip
// and panel packed in the replay's form, MXCSR's flush-to-zero cleared (the
// replay flushes as the contract says itself, and must see the subnormals).
template <class Mat>
void replay_tile(const Mat& A, const Mat& B, int64_t i0, int64_t mv, int64_t j0, int64_t nv, int64_t k0, int64_t kp,
                 int64_t K, float* c, int64_t ldc, bool load) {
  const Bf16Kernel& uk = kAvx512Kernel;
  static thread_local Scratch a_fp32, b_fp32;
  uint32_t* a = a_fp32.get(static_cast<size_t>(2 * kp * uk.mr));
  uint32_t* b = b_fp32.get(static_cast<size_t>(2 * kp * uk.nr));
  pack_a(A, i0, mv, uk, k0, kp, K, a);
  pack_b(B, j0, nv, uk, k0, kp, K, b);
  const FlushToZero no_ftz(false);
  run_tile(uk, kp, a, b, c, ldc, mv, nv, load);
}

}  // namespace

void set_gemm_bf16_path(Bf16Path path) { g_forced.store(static_cast<int>(path)); }
Bf16Path gemm_bf16_path() { return effective_path(); }
bool gemm_bf16_path_supported(Bf16Path path) { return cpu_has(path); }
int64_t gemm_bf16_tiny_fallbacks() { return g_tiny_fallbacks.load(std::memory_order_relaxed); }

const char* bf16_path_name(Bf16Path p) {
  switch (p) {
    case Bf16Path::kAmx:
      return "amx";
    case Bf16Path::kAvx512:
      return "avx512";
    case Bf16Path::kAvx512Bf16:
      return "avx512-bf16";
    case Bf16Path::kAvx2:
      return "avx2";
    case Bf16Path::kScalar:
      return "scalar";
    default:
      return "auto";
  }
}

void gemm_bf16_naive(int64_t M, int64_t N, int64_t K, ConstMatBf16 A, ConstMatBf16 B, float* C, int64_t ldc,
                     bool accumulate) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const float start = accumulate ? C[i * ldc + j] : 0.0f;
      C[i * ldc + j] = ls::bf16_dot(A.p + i * A.rs, A.cs, B.p + j * B.cs, B.rs, K, start);
    }
}

namespace {

// gemm_bf16 over either kind of operand (stored bf16, or fp32 rounded as packed).
template <class Mat>
void gemm_bf16_packed(int64_t M, int64_t N, int64_t K, const Mat& A, const Mat& B, float* C, int64_t ldc,
                      bool accumulate, int threads) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) memset(C + i * ldc, 0, sizeof(float) * N);
    return;
  }
  const Bf16Kernel& uk = kernel_for(effective_path());
  const bool pairs = uk.form == Packed::kPairs;  // avx512-bf16: each tile checked (vdpbf16ps_exact)
  const int MR = uk.mr, NR = uk.nr;
  const int64_t K32 = (K + kBf16FoldBlock - 1) / kBf16FoldBlock * kBf16FoldBlock;  // K padded
  const int64_t KC = std::min(K32, uk.form != Packed::kFp32 ? kKCPairs : kKCFp32);
  const int64_t MC = std::max<int64_t>(MR, kMC / MR * MR);
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t mblocks = (M + MC - 1) / MC;

  int T = threads > 0 ? threads : (omp_in_parallel() || in_pool_job() ? 1 : omp_get_max_threads());
  if (M * N * K < (int64_t(1) << 18)) T = 1;  // tiny products: not worth waking threads
  // Tasks: A row blocks x groups of B panels; split N only when M is short.
  int64_t groups = 1;
  if (T > 1 && mblocks < 4 * T) groups = std::min(panels, (4 * T + mblocks - 1) / mblocks);
  const int64_t per_group = (panels + groups - 1) / groups;
  groups = (panels + per_group - 1) / per_group;
  const int64_t tasks = mblocks * groups;
  T = static_cast<int>(std::min<int64_t>(T, tasks));

  // Words per packed k pair of one line: 1 (pairs) or 2 (two fp32).
  const int64_t wpp = uk.form != Packed::kFp32 ? 1 : 2;
  static thread_local Scratch b_scratch;
  uint32_t* bpack = b_scratch.get(static_cast<size_t>(KC / 2 * wpp * panels * NR));
  // avx512-bf16: the smallest exponent in each packed panel and strip of this k block.
  static thread_local std::vector<int> panel_exponents;
  if (pairs) panel_exponents.resize(static_cast<size_t>(panels));
  int* panel_exp = panel_exponents.data();  // the caller's, filled by every thread
  auto pack_panels = [&](int64_t p0, int64_t p1, int64_t k0, int64_t kp) {
    internal::pack_b_panels(B, N, p0, p1, uk, k0, kp, K, bpack);
    if (pairs)
      for (int64_t p = p0; p < p1; ++p) panel_exp[p] = internal::packed_min_exponent(bpack + p * kp * NR, kp * NR);
  };
  std::atomic<bool> fell_back{false};
  // One task: its row block's A strips packed, then its panels' tiles.
  auto run_task = [&](int64_t t, int64_t k0, int64_t kp, bool load, uint32_t* apack) {
    const FlushToZero ftz(pairs);  // once per task, not per kernel call
    const int64_t ib = t / groups, g = t % groups;
    const int64_t i0 = ib * MC, mc = std::min(MC, M - i0);
    const int64_t strips = (mc + MR - 1) / MR, strip_words = kp * wpp * MR;
    int strip_exp[kMC];  // strips <= kMC / MR + 1
    for (int64_t s = 0; s < strips; ++s) {
      pack_a(A, i0 + s * MR, std::min<int64_t>(MR, mc - s * MR), uk, k0, kp, K, apack + s * strip_words);
      if (pairs) strip_exp[s] = internal::packed_min_exponent(apack + s * strip_words, kp * MR);
    }
    const int64_t p_end = std::min(panels, (g + 1) * per_group);
    for (int64_t p = g * per_group; p < p_end; ++p) {
      const int64_t nv = std::min<int64_t>(NR, N - p * NR);
      for (int64_t s = 0; s < strips; ++s) {
        float* c = C + (i0 + s * MR) * ldc + p * NR;
        const int64_t mv = std::min<int64_t>(MR, mc - s * MR);
        if (pairs && !vdpbf16ps_exact(strip_exp[s], panel_exp[p])) {
          replay_tile(A, B, i0 + s * MR, mv, p * NR, nv, k0, kp, K, c, ldc, load);
          fell_back.store(true, std::memory_order_relaxed);
          continue;
        }
        run_tile(uk, kp, apack + s * strip_words, bpack + p * kp * wpp * NR, c, ldc, mv, nv, load);
      }
    }
  };

  static thread_local Scratch a_scratch;
  const size_t a_words = static_cast<size_t>(KC / 2 * wpp * (MC + MR));
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kp = std::min(KC, K32 - k0) / 2;  // a multiple of 16
    const bool load = accumulate || k0 > 0;
    if (T == 1) {
      uint32_t* apack = a_scratch.get(a_words);
      pack_panels(0, panels, k0, kp);
      for (int64_t t = 0; t < tasks; ++t) run_task(t, k0, kp, load, apack);
      continue;
    }
    const int64_t per_pack = (panels + T - 1) / T;  // each thread a run of panels
    run_on_threads(T, (panels + per_pack - 1) / per_pack, [&](JobIndices& job) {
      for (int64_t j; job.next(&j);) pack_panels(j * per_pack, std::min(panels, (j + 1) * per_pack), k0, kp);
    });
    run_on_threads(T, tasks, [&](JobIndices& job) {
      uint32_t* apack = a_scratch.get(a_words);
      for (int64_t t; job.next(&t);) run_task(t, k0, kp, load, apack);
    });
  }
  if (fell_back.load(std::memory_order_relaxed)) g_tiny_fallbacks.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

void gemm_bf16(int64_t M, int64_t N, int64_t K, ConstMatBf16 A, ConstMatBf16 B, float* C, int64_t ldc,
               bool accumulate, int threads) {
  gemm_bf16_packed(M, N, K, A, B, C, ldc, accumulate, threads);
}

void gemm_bf16_rounded(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc,
                       bool accumulate, int threads) {
  gemm_bf16_packed(M, N, K, A, B, C, ldc, accumulate, threads);
}

}  // namespace ops
}  // namespace ls
