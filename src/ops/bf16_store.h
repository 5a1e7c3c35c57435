// Tensors kept as bf16 between the forward and the backward
// (numerics.precision=bf16, docs/NUMERICS.md §10 "What is stored as bf16"):
// the conversions, whole arrays at a time. A value the recipe rounds to
// bf16 is kept in 16 bits and read back as the same float, so keeping it
// so changes no bit; these only move values, they reduce over nothing.
#pragma once

#include <cstdint>

namespace ls::ops {

// y[i] = ls::to_bf16(x[i]): round to nearest even, a NaN kept quiet.
void to_bf16_n(const float* x, uint16_t* y, int64_t n);
// y[i] = ls::from_bf16(x[i]): exact.
void from_bf16_n(const uint16_t* x, float* y, int64_t n);
// x[i] = ls::from_bf16(ls::to_bf16(x[i])): each value rounded to bf16 in place.
void round_bf16_n(float* x, int64_t n);

}  // namespace ls::ops
