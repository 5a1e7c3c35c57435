// The contract's bf16: the rounding of fp32 to bf16 and the bf16 fold over k
// (docs/NUMERICS.md, "The bf16 fold"). Included by contract.h after LS_HD,
// ls::bits, ls::from_bits and ls::fma are defined.
//
// The fold is the one AMX's TDPBF16PS computes (verified bit for bit on
// 10 M random lanes by a probe; the gemm_bf16 suite runs the directed edge
// cases on the amx path wherever the CPU has AMX), so
// that instruction runs it at full rate; every other path (and the CUDA
// kernels) replays it with the steps below. Per output, from the start value
// (a GEMM's +0, or C):
//   k in blocks of 32 (one tile op: 16 pairs), ascending; past K, a = b = +0
//   (so every block is full); per block, E folds the even k and O the odd k,
//   each from +0, ascending: step = round(acc + a*b), the product exact (one
//   rounding: an fma), round-to-nearest-even to 24 significant bits; then
//   S = round(E + O) and C = round(S + C);
//   flushing: an input (a, b, or the start value) below 2^-126 in magnitude
//   counts as a zero of its sign (DAZ); a step or add whose rounded result is
//   below 2^-126 in magnitude gives a zero of its sign (FTZ), where "rounded"
//   is to 24 bits with an unbounded exponent (tininess after rounding);
//   a NaN result is the canonical quiet NaN 0x7fc00000.
#pragma once

namespace ls {

// bf16 is an explicit round-to-nearest-even of an fp32 value (NaN kept quiet).
LS_HD uint16_t to_bf16(float x) {
  uint32_t u = bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)((u + rounding) >> 16);
}
LS_HD float from_bf16(uint16_t h) { return from_bits((uint32_t)h << 16); }

// DAZ / FTZ: a value below 2^-126 in magnitude (a subnormal) becomes a zero
// of its sign. The contract never sets the hardware's flush modes (rule 1):
// the bf16 fold flushes by name, here.
LS_HD float bf16_flush(float x) {
  uint32_t u = bits(x);
  return (u & 0x7f800000u) ? x : from_bits(u & 0x80000000u);
}
// A bf16 input of the fold: its fp32 value, flushed.
LS_HD float bf16_in(uint16_t h) { return bf16_flush(from_bf16(h)); }

// One step of the fold: acc + a*b rounded once, flushed when tiny. a, b and
// acc are flushed already (a and b bf16 values). fma rounds onto the
// subnormal grid, which agrees with rounding at an unbounded exponent except
// when fma's result is exactly +-2^-126: the exact sum may lie in
// [2^-126 - 2^-150, 2^-126 - 2^-151), which rounds to a tiny 24-bit value
// (flushed) although fma rounds it up to 2^-126. Redone 2^64 higher, where
// it is normal, the step tells the two apart. (There |a*b| < 2^-100 and the
// smaller factor is below 2^-50, so scaling it by 2^64 is exact.)
LS_HD float bf16_fold_step(float acc, float a, float b) {
  const float r = ls::fma(a, b, acc);
  const uint32_t m = bits(r) & 0x7fffffffu;
  if (m > 0x00800000u) return r;                                 // normal, inf or NaN
  if (m < 0x00800000u) return from_bits(bits(r) & 0x80000000u);  // tiny: flushed
  const bool a_smaller = (bits(a) & 0x7fffffffu) <= (bits(b) & 0x7fffffffu);
  const float sa = a_smaller ? a * 0x1p64f : a, sb = a_smaller ? b : b * 0x1p64f;
  const float g = ls::fma(sa, sb, acc * 0x1p64f);
  return (bits(g) & 0x7fffffffu) < 0x20800000u ? from_bits(bits(g) & 0x80000000u) : r;  // 2^-62
}

// The fold's adds (S = E + O, C = S + C): x + y rounded once, flushed when
// tiny. x and y are flushed fp32 values, multiples of 2^-149, so a sum below
// 2^-126 in magnitude is exact (a subnormal fp32 holds it): flushing the fp32
// add's subnormal result is tininess after rounding, with no boundary case.
LS_HD float bf16_add_step(float x, float y) { return bf16_flush(x + y); }

// k per block of the fold: one TDPBF16PS tile op (16 pairs).
constexpr int64_t kBf16FoldBlock = 32;

// A NaN result of the fold is this one NaN: which input NaN's payload
// hardware passes on differs between instructions and devices.
LS_HD float bf16_canonical_nan(float x) {
  return (bits(x) & 0x7fffffffu) > 0x7f800000u ? from_bits(0x7fc00000u) : x;
}

// The fold itself, the definition every bf16 GEMM path must match: the dot
// product of a[k*as] and b[k*bs] over k = 0..K-1, from `start` (a GEMM's +0,
// or C when it accumulates). K = 0 gives `start` untouched. Continuing a fold
// (start = an earlier result) equals one fold over both ranges only when the
// first range's length is a multiple of 32 (kBf16FoldBlock): else its last
// block was padded and the next range's k fall into other blocks.
LS_HD float bf16_dot(const uint16_t* a, int64_t as, const uint16_t* b, int64_t bs, int64_t K,
                     float start) {
  if (K <= 0) return start;
  float c = bf16_flush(start);
  for (int64_t k0 = 0; k0 < K; k0 += kBf16FoldBlock) {
    float e = 0.0f, o = 0.0f;
    for (int64_t k = k0; k < k0 + kBf16FoldBlock; k += 2) {  // past K: +0 * +0
      e = bf16_fold_step(e, k < K ? bf16_in(a[k * as]) : 0.0f, k < K ? bf16_in(b[k * bs]) : 0.0f);
      o = bf16_fold_step(o, k + 1 < K ? bf16_in(a[(k + 1) * as]) : 0.0f, k + 1 < K ? bf16_in(b[(k + 1) * bs]) : 0.0f);
    }
    c = bf16_add_step(bf16_add_step(e, o), c);
  }
  return bf16_canonical_nan(c);
}

}  // namespace ls
