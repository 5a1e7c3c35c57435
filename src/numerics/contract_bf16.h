// The contract's bf16: the rounding of fp32 to bf16 and the bf16 fold over k
// (docs/NUMERICS.md, "The bf16 fold"). Included by contract.h after LS_HD,
// ls::bits, ls::from_bits and ls::fma are defined.
//
// The fold is the one AVX512_BF16's vdpbf16ps computes, so that instruction
// runs it at full rate; every other path (and the CUDA kernels) replays it
// with the steps below. Per output, from +0 (or a start value):
//   k in pairs (2j, 2j+1), ascending j; inside a pair, k = 2j+1 first;
//   each step: acc = round(acc + a*b), the product exact (one rounding: an
//   fma), round-to-nearest-even to 24 significant bits;
//   flushing: an input (a, b, or the start value) below 2^-126 in magnitude
//   counts as a zero of its sign (DAZ); a step whose rounded result is below
//   2^-126 in magnitude gives a zero of its sign (FTZ), where "rounded" is to
//   24 bits with an unbounded exponent (tininess after rounding, as x86 does);
//   an odd K is padded with one pair member a = b = +0 (so the last pair's
//   first step adds +0: a -0 accumulator becomes +0);
//   a NaN result is the canonical quiet NaN 0x7fc00000.
// Verified against vdpbf16ps lane by lane (tests/test_gemm_bf16.cc, and on
// 48 M random lanes biased to the 2^-126 boundary).
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

// One pair of the fold (one vdpbf16ps lane): the odd member's product, then
// the even member's, onto a flushed accumulator.
LS_HD float bf16_fold_pair(float acc, uint16_t a_even, uint16_t b_even, uint16_t a_odd, uint16_t b_odd) {
  acc = bf16_fold_step(acc, bf16_in(a_odd), bf16_in(b_odd));
  return bf16_fold_step(acc, bf16_in(a_even), bf16_in(b_even));
}

// A NaN result of the fold is this one NaN: which input NaN's payload
// hardware passes on differs between instructions and devices.
LS_HD float bf16_canonical_nan(float x) {
  return (bits(x) & 0x7fffffffu) > 0x7f800000u ? from_bits(0x7fc00000u) : x;
}

// The fold itself, the definition every bf16 GEMM path must match: the dot
// product of a[k*as] and b[k*bs] over k = 0..K-1, from `start` (a GEMM's +0,
// or C when it accumulates). K = 0 gives `start` untouched. Continuing a fold
// (start = an earlier result) equals one fold over both ranges only when the
// first range has even length.
LS_HD float bf16_dot(const uint16_t* a, int64_t as, const uint16_t* b, int64_t bs, int64_t K,
                     float start) {
  if (K <= 0) return start;
  float acc = bf16_flush(start);
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t a_odd = k + 1 < K ? a[(k + 1) * as] : 0;  // odd K: padded with +0
    const uint16_t b_odd = k + 1 < K ? b[(k + 1) * bs] : 0;
    acc = bf16_fold_pair(acc, a[k * as], b[k * bs], a_odd, b_odd);
  }
  return bf16_canonical_nan(acc);
}

}  // namespace ls
