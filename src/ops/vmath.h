// Batch contract math: the functions of contract_math.h over arrays, SIMD
// where the CPU allows, with bits equal to the scalar ls:: function applied
// to each element (same IEEE operations per lane, branches as masks).
// Elementwise only: no reduction, so no order to fix.
#pragma once

#include <stdint.h>

#include "ops/gemm.h"  // GemmPath: the instruction-set path enum, shared

namespace ls {
namespace ops {

// y[i] = ls::cexp(x[i]) for i in [0, n), bit for bit.
void exp_n(const float* x, float* y, int64_t n);
// y[i] = ls::csigmoid(x[i]) for i in [0, n), bit for bit.
void sigmoid_n(const float* x, float* y, int64_t n);
// y[i] = ls::cexp(x[i] - m), the subtraction one rounded binary32 sub: the
// max-shifted exponent of a softmax row, bit for bit.
void exp_shifted_n(const float* x, float m, float* y, int64_t n);
// All three accept y == x (in place); other overlaps are not allowed.
// Pointers need no alignment.

// Instruction-set path, process-wide, for tests and benchmarks. kAuto picks
// the best the CPU supports; forcing a path the CPU lacks falls back to
// kAuto's choice. Independent of set_gemm_path.
void set_vmath_path(GemmPath path);
const char* vmath_path_name();  // "scalar", "avx2" or "avx512": the path in use
bool vmath_path_supported(GemmPath path);

}  // namespace ops
}  // namespace ls
