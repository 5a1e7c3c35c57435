// Contract GEMM: GotoBLAS-style blocking with the k order kept intact.
//
// Loop nest: k blocks of kc (ascending, outermost); B packed into column
// panels of NR (k-major, so a kernel step is NR/lanes contiguous loads);
// A read in place (broadcasts need no packing; only a ragged last strip of
// fewer than MR rows is copied, zero-padded); a register-blocked
// micro-kernel per MR x NR tile of C, rows in blocks of MC for L2 reuse. Between k blocks the fp32 partial sums
// are stored to C and reloaded: a stored binary32 is the same value, so each
// C element is still the one sequential fma fold over k of gemm_naive.
// Threads split output tiles only; no element is ever computed by two.
#include "ops/gemm.h"
#include "common/op_profile.h"
#include "common/numerics_level.h"
#include "ops/local.h"
#include "ops/dispatch.h"

#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <new>

#include "common/thread_pool.h"
#include "numerics/contract.h"
#include "ops/aligned_scratch.h"
#include "ops/transpose8.h"

namespace ls {
namespace ops {
namespace internal {

// A micro-kernel: the C tile (mr x nr, row stride ldc) gets the fold over kc
// k steps of A (element (r,k) at a[r*ars + k*acs]) times a B panel (kc x nr,
// row k at b + k*ldb: packed with ldb = nr, or read in place from a row-major
// B), starting from C when `load`, else from +0.
using UKernelFn = void (*)(int64_t kc, const float* a, int64_t ars, int64_t acs, const float* b,
                           int64_t ldb, float* c, int64_t ldc, bool load);
struct UKernelInfo {
  int mr;
  int nr;
  UKernelFn fn;
};
// gemm_avx512.cc (built with AVX-512 flags; called only when the CPU has it).
void gemm_ukernel_avx512_8x32(int64_t kc, const float* a, int64_t ars, int64_t acs,
                              const float* b, int64_t ldb, float* c, int64_t ldc, bool load);

}  // namespace internal

namespace {

using internal::UKernelInfo;

// ------------------------------------------------------------ kernels ----

// Scalar: one ls::fma per (row, column, k). Reduces over k sequentially.
template <int MR, int NR>
void ukernel_scalar(int64_t kc, const float* a, int64_t ars, int64_t acs, const float* b,
                    int64_t ldb, float* c, int64_t ldc, bool load) {
  float acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = load ? c[r * ldc + j] : 0.0f;
  for (int64_t k = 0; k < kc; ++k) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = ls::fma(a[r * ars], b[j], acc[r][j]);
    a += acs;
    b += ldb;
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = acc[r][j];
}

// AVX2 + FMA: 6 x 16 tile in 12 ymm accumulators. Reduces over k
// sequentially; each lane is one C element's fold.
void ukernel_avx2(int64_t kc, const float* a, int64_t ars, int64_t acs, const float* b,
                  int64_t ldb, float* c, int64_t ldc, bool load) {
  constexpr int MR = 6;
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = load ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
    acc[r][1] = load ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m256 ar = _mm256_broadcast_ss(a + r * ars);
      acc[r][0] = _mm256_fmadd_ps(ar, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(ar, b1, acc[r][1]);
    }
    a += acs;
    b += ldb;
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

const UKernelInfo kScalarKernel = {4, 8, ukernel_scalar<4, 8>};
const UKernelInfo kAvx2Kernel = {6, 16, ukernel_avx2};
const UKernelInfo kAvx512Kernel = {8, 32, internal::gemm_ukernel_avx512_8x32};

// ------------------------------------------------------------ dispatch ----

std::atomic<int> g_forced{static_cast<int>(GemmPath::kAuto)};

bool cpu_has(GemmPath p) {
  switch (p) {
    case GemmPath::kAuto:
    case GemmPath::kScalar:
      return true;
    case GemmPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemmPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  return false;
}

GemmPath effective_path() {
  GemmPath p = static_cast<GemmPath>(g_forced.load(std::memory_order_relaxed));
  if (p != GemmPath::kAuto && cpu_has(p)) return p;
  return best_cpu_path();
}

const UKernelInfo& kernel_for(GemmPath p) {
  if (p == GemmPath::kAvx512) return kAvx512Kernel;
  if (p == GemmPath::kAvx2) return kAvx2Kernel;
  return kScalarKernel;
}

// ------------------------------------------------------------- packing ----

// Grow-only 64-byte aligned scratch, one per thread.
using Scratch = AlignedScratch<float>;

// dst[k*MR + r] = A(i0 + r, k0 + k) for r < mv, 0 for the padding rows.
// Only edge strips are packed; full strips are read in place.
void pack_a_edge(const ConstMat& A, int64_t i0, int mv, int MR, int64_t k0, int64_t kc,
                 float* dst) {
  for (int64_t k = 0; k < kc; ++k) {
    const float* src = A.p + (k0 + k) * A.cs + i0 * A.rs;
    for (int r = 0; r < mv; ++r) dst[k * MR + r] = src[r * A.rs];
    for (int r = mv; r < MR; ++r) dst[k * MR + r] = 0.0f;
  }
}

// dst[k*NR + j] = B(k0 + k, j0 + j) for j < nv, 0 for the padding columns.
void pack_b(const ConstMat& B, int64_t k0, int64_t kc, int64_t j0, int nv, int NR,
            float* dst) {
  if (B.cs == 1) {
    for (int64_t k = 0; k < kc; ++k) {
      memcpy(dst + k * NR, B.p + (k0 + k) * B.rs + j0, sizeof(float) * nv);
      for (int j = nv; j < NR; ++j) dst[k * NR + j] = 0.0f;
    }
    return;
  }
  const float* src = B.p + k0 * B.rs + j0 * B.cs;
  int64_t k = 0;
  if (B.rs == 1 && nv % 8 == 0) {  // transposed view: 8 x 8 blocks
    for (; k + 8 <= kc; k += 8)
      for (int j = 0; j < nv; j += 8) transpose8x8(src + j * B.cs + k, B.cs, dst + k * NR + j, NR);
  }
  for (; k < kc; ++k)
    for (int j = 0; j < nv; ++j) dst[k * NR + j] = src[k * B.rs + j * B.cs];
  if (nv < NR)
    for (k = 0; k < kc; ++k)
      for (int j = nv; j < NR; ++j) dst[k * NR + j] = 0.0f;
}

// One micro-tile; partial tiles go through an MR x NR buffer so the kernel
// always sees a full tile (padding lanes are computed and dropped).
inline void run_tile(const UKernelInfo& uk, int64_t kc, const float* a, int64_t ars,
                     int64_t acs, const float* b, int64_t ldb, float* c, int64_t ldc, int mv, int nv,
                     bool load) {
  if (mv == uk.mr && nv == uk.nr) {
    uk.fn(kc, a, ars, acs, b, ldb, c, ldc, load);
    return;
  }
  alignas(64) float tile[16 * 64];  // >= every kernel's MR x NR
  if (load)
    for (int r = 0; r < mv; ++r) memcpy(tile + r * uk.nr, c + r * ldc, sizeof(float) * nv);
  uk.fn(kc, a, ars, acs, b, ldb, tile, uk.nr, load);
  for (int r = 0; r < mv; ++r) memcpy(c + r * ldc, tile + r * uk.nr, sizeof(float) * nv);
}

constexpr int64_t kKC = 256;  // k block: B panel (kc x NR) stays in L1
constexpr int64_t kMC = 192;  // rows per A block (rounded to MR): A block (192 KB) in L2

}  // namespace

void set_gemm_path(GemmPath path) { g_forced.store(static_cast<int>(path)); }

bool gemm_path_supported(GemmPath path) { return cpu_has(path); }

GemmPath best_cpu_path() {
  static const GemmPath best = cpu_has(GemmPath::kAvx512) ? GemmPath::kAvx512
                               : cpu_has(GemmPath::kAvx2) ? GemmPath::kAvx2
                                                          : GemmPath::kScalar;
  return best;
}

GemmPath gemm_path() { return effective_path(); }

const char* path_name(GemmPath path) {
  switch (path) {
    case GemmPath::kAvx512:
      return "avx512";
    case GemmPath::kAvx2:
      return "avx2";
    case GemmPath::kScalar:
      return "scalar";
    default:
      return "auto";
  }
}

const char* gemm_path_name() { return path_name(effective_path()); }

void gemm_naive(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C,
                int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float acc = accumulate ? C[i * ldc + j] : 0.0f;
      // Reduces over k sequentially from C (or +0).
      for (int64_t k = 0; k < K; ++k)
        acc = ls::fma(A.p[i * A.rs + k * A.cs], B.p[k * B.rs + j * B.cs], acc);
      C[i * ldc + j] = acc;
    }
}

void gemm(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc,
          bool accumulate, int threads) {
  const OpTimer op_timer(OpKind::kGemm);
  if (auto k = kernel(&OpHooks::gemm)) return k(M, N, K, A, B, C, ldc, accumulate);
  if (local_numerics()) return local::gemm(M, N, K, A, B, C, ldc, accumulate);
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) memset(C + i * ldc, 0, sizeof(float) * N);
    return;
  }
  const UKernelInfo& uk = kernel_for(effective_path());
  const int MR = uk.mr, NR = uk.nr;
  const int64_t KC = std::min(K, kKC);
  const int64_t MC = std::max<int64_t>(MR, kMC / MR * MR);
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t mblocks = (M + MC - 1) / MC;

  int T = threads > 0 ? threads : (omp_in_parallel() || in_pool_job() ? 1 : omp_get_max_threads());
  // Tiny products are not worth waking threads (does not change any bit).
  if (M * N * K < (int64_t(1) << 18)) T = 1;
  // Tasks: A row blocks x groups of B panels; split N only when M is short.
  int64_t groups = 1;
  if (T > 1 && mblocks < 4 * T) groups = std::min(panels, (4 * T + mblocks - 1) / mblocks);
  const int64_t per_group = (panels + groups - 1) / groups;
  groups = (panels + per_group - 1) / per_group;
  const int64_t tasks = mblocks * groups;
  T = static_cast<int>(std::min<int64_t>(T, tasks));

  static thread_local Scratch b_scratch;
  float* bpack = b_scratch.get(static_cast<size_t>(KC * panels * NR));

  // A full panel of a row-major B is read where it lies when packing would not
  // pay back: one row block of A, and a row stride that is not a multiple of
  // 1 KiB (whose rows would crowd a few L1 sets). The others are packed.
  const bool b_in_place = B.cs == 1 && mblocks == 1 && B.rs % 256 != 0;
  auto in_place = [&](int nv) { return b_in_place && nv == NR; };
  // One k block: pack B, then run the tasks. Each output keeps its sequential fold over k
  // whatever the split, so the serial and threaded paths give the same bits.
  auto run_task = [&](int64_t t, int64_t k0, int64_t kc, bool load, float* aedge) {
    const int64_t ib = t / groups, g = t % groups;
    const int64_t i0 = ib * MC, mc = std::min(MC, M - i0);
    const int64_t strips = (mc + MR - 1) / MR;
    const int medge = static_cast<int>(mc - (strips - 1) * MR);
    if (medge < MR) pack_a_edge(A, i0 + (strips - 1) * MR, medge, MR, k0, kc, aedge);
    const int64_t p_end = std::min(panels, (g + 1) * per_group);
    for (int64_t p = g * per_group; p < p_end; ++p) {
      const int nv = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
      const bool direct = in_place(nv);
      const float* bp = direct ? B.p + k0 * B.rs + p * NR : bpack + p * kc * NR;
      const int64_t ldb = direct ? B.rs : NR;
      for (int64_t s = 0; s < strips; ++s) {
        const int64_t i = i0 + s * MR;
        float* c = C + i * ldc + p * NR;
        if (s + 1 < strips || medge == MR)
          run_tile(uk, kc, A.p + i * A.rs + k0 * A.cs, A.rs, A.cs, bp, ldb, c, ldc, MR, nv, load);
        else
          run_tile(uk, kc, aedge, 1, MR, bp, ldb, c, ldc, medge, nv, load);
      }
    }
  };
  auto pack_panel = [&](int64_t p, int64_t k0, int64_t kc) {
    if (in_place(static_cast<int>(std::min<int64_t>(NR, N - p * NR)))) return;
    pack_b(B, k0, kc, p * NR, static_cast<int>(std::min<int64_t>(NR, N - p * NR)), NR, bpack + p * kc * NR);
  };

  // Each thread's buffer for a packed A edge strip.
  static thread_local Scratch a_scratch;
  if (T == 1) {
    // The same two phases inline, without a pool job (and its std::function)
    // per k block: weight gradients make many small single-thread calls.
    float* aedge = a_scratch.get(static_cast<size_t>(KC * MR));
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t p = 0; p < panels; ++p) pack_panel(p, k0, kc);
      for (int64_t t = 0; t < tasks; ++t) run_task(t, k0, kc, accumulate || k0 > 0, aedge);
    }
    return;
  }
  // Threads: helpers of the calling thread's pool; two short jobs per k block
  // (pack B, then the tasks), each ending when all its indices have run.
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    if (!(b_in_place && N % NR == 0))
      run_on_threads(T, panels, [&](JobIndices& job) {
        for (int64_t p; job.next(&p);) pack_panel(p, k0, kc);
      });
    run_on_threads(T, tasks, [&](JobIndices& job) {
      float* aedge = a_scratch.get(static_cast<size_t>(KC * MR));
      for (int64_t t; job.next(&t);) run_task(t, k0, kc, accumulate || k0 > 0, aedge);
    });
  }
}

}  // namespace ops
}  // namespace ls
