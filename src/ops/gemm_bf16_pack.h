// The bf16 GEMM's packing (gemm_bf16.cc): how each instruction-set path's
// micro-kernel wants its operands laid out, and the functions that put a
// strip of A or a run of B's panels in that form, rounding fp32 operands to
// bf16 (ls::to_bf16) as they are read. Internal to src/ops.
#pragma once

#include <cstdint>

#include "ops/gemm_bf16.h"

namespace ls::ops::internal {

// A micro-kernel: the C tile (mr x nr, row stride ldc) gets the fold over kp
// k pairs (a multiple of 16) of a packed A strip and a packed B panel, from
// C (flushed) when `load`, else from +0; NaNs stored canonical.
using Bf16KernelFn = void (*)(int64_t kp, const void* a, const void* b, float* c, int64_t ldc, bool load);
// How a kernel wants its operands packed.
enum class Packed { kFp32, kTiles, kPairs };  // described at the top of gemm_bf16.cc
struct Bf16Kernel {
  int mr;
  int nr;
  Packed form;
  Bf16KernelFn fn;
  bool tiles() const { return form == Packed::kTiles; }
};

// MR rows of A from row i0 (mv of them real), k block [k0, k0 + 2kp), into
// dst in uk's form.
template <class Mat>
void pack_a(const Mat& A, int64_t i0, int64_t mv, const Bf16Kernel& uk, int64_t k0, int64_t kp, int64_t K,
            uint32_t* dst);
// NR columns of B from column j0 (nv of them real), the same k block.
template <class Mat>
void pack_b(const Mat& B, int64_t j0, int64_t nv, const Bf16Kernel& uk, int64_t k0, int64_t kp, int64_t K,
            uint32_t* dst);
// B's panels [p0, p1) of NR columns each (N in all), panel p at bpack + p *
// kp * (words per pair) * NR. In the pairs form with B's columns side by
// side, pair row by pair row across the panels, so the reads walk B's rows
// in order rather than one strip of every row per panel.
template <class Mat>
void pack_b_panels(const Mat& B, int64_t N, int64_t p0, int64_t p1, const Bf16Kernel& uk, int64_t k0, int64_t kp,
                   int64_t K, uint32_t* bpack);

// The smallest biased exponent among the nonzero bf16 halves of n packed
// pair words (n a multiple of 8), 255 when there is none; exponent 0 (zero,
// or a subnormal the fold reads as zero) is skipped. Read off the packed
// operand, so an fp32 value is judged as it was rounded.
int packed_min_exponent(const uint32_t* w, int64_t n);

}  // namespace ls::ops::internal
