// The numerics contract itself: compiler contraction is off, the canonical
// tree, Philox known answers, bf16 rounding and the bf16 fold, the state hash serialization.
#include <doctest/doctest.h>
#include <xxhash.h>

#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#include "contract.h"

namespace {

// Not inlined, so the compiler sees a*b+c with unknown operands. With
// -ffp-contract=off it must round a*b before the add.
__attribute__((noinline)) float mul_add(float a, float b, float c) { return a * b + c; }

float recursive_tree(const std::vector<float>& v, size_t lo, size_t n) {
  if (n == 1) return v[lo];
  size_t p = 1;
  while (p * 2 < n) p *= 2;
  return recursive_tree(v, lo, p) + recursive_tree(v, lo + p, n - p);
}

}  // namespace

TEST_SUITE("contract") {
  TEST_CASE("compiler contraction is off: a*b+c rounds twice, ls::fma once") {
    // a = b = 1 + 2^-23: a*b = 1 + 2^-22 + 2^-46; c = -(1 + 2^-22).
    const float a = 1.0f + 0x1p-23f, c = -(1.0f + 0x1p-22f);
    CHECK(mul_add(a, a, c) == 0.0f);             // product rounded, then added
    CHECK(ls::fma(a, a, c) == 0x1p-46f);          // fused: the 2^-46 survives
    CHECK(mul_add(a, a, c) != ls::fma(a, a, c));  // the two really differ
  }

  TEST_CASE("subnormals are kept (no flush-to-zero)") {
    volatile float tiny = 0x1p-140f;
    CHECK(tiny * 0.5f == 0x1p-141f);
    CHECK(ls::fma(tiny, 1.0f, 0.0f) == 0x1p-140f);
  }

  TEST_CASE("tree_split: left subtree is the largest power of two below n") {
    CHECK(ls::tree_split(2) == 1);
    CHECK(ls::tree_split(3) == 2);
    CHECK(ls::tree_split(4) == 2);
    CHECK(ls::tree_split(5) == 4);
    CHECK(ls::tree_split(8) == 4);
    CHECK(ls::tree_split(9) == 8);
  }

  TEST_CASE("LeafTree (binary counter) builds exactly the canonical tree") {
    for (int n = 1; n <= 40; ++n) {
      const int width = 3;
      std::vector<std::vector<float>> leaves(n, std::vector<float>(width));
      for (int l = 0; l < n; ++l)
        for (int i = 0; i < width; ++i)
          leaves[l][i] = ls::random_symmetric(7, ls::Purpose::kTest, (uint64_t)(l * width + i), 1.0f) *
                         (float)(1 << (l % 13));  // varied magnitudes: order matters
      std::vector<float> scratch((size_t)ls::LeafTree::levels_for(n) * width);
      ls::LeafTree tree(scratch.data(), width);
      for (int l = 0; l < n; ++l) {
        std::memcpy(tree.next_leaf(), leaves[l].data(), sizeof(float) * width);
        tree.push();
      }
      const float* got = tree.finish();
      for (int i = 0; i < width; ++i) {
        std::vector<float> col(n);
        for (int l = 0; l < n; ++l) col[l] = leaves[l][i];
        CHECK(ls::bits(got[i]) == ls::bits(recursive_tree(col, 0, n)));
        CHECK(ls::bits(got[i]) == ls::bits(ls::tree_sum(col.data(), n)));
      }
    }
  }

  TEST_CASE("the tree is not a left fold: order is observable") {
    // ((1e8 + 1) + -1e8) + 1 vs (1e8 + 1) + (-1e8 + 1): 4 leaves -> (a+b)+(c+d).
    std::vector<float> v = {1e8f, 1.0f, -1e8f, 1.0f};
    const float fold = ((v[0] + v[1]) + v[2]) + v[3];
    CHECK(ls::tree_sum(v.data(), 4) == (v[0] + v[1]) + (v[2] + v[3]));
    CHECK(ls::tree_sum(v.data(), 4) != fold);
  }

  TEST_CASE("param_sumsq: fma fold in blocks of kParamBlock, canonical tree over blocks") {
    std::vector<float> v(3000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = ls::random_symmetric(3, ls::Purpose::kTest, i, 2.0f);
    auto block = [&](size_t lo, size_t hi) {
      float acc = 0.0f;
      for (size_t i = lo; i < hi; ++i) acc = ls::fma(v[i], v[i], acc);
      return acc;
    };
    const float want = (block(0, 1024) + block(1024, 2048)) + block(2048, 3000);
    CHECK(ls::bits(ls::param_sumsq(v.data(), 3000)) == ls::bits(want));
  }

  TEST_CASE("Philox4x32-10 matches the Random123 known-answer vectors") {
    ls::U32x4 r = ls::philox4x32_10(0, 0, 0, 0, 0, 0);
    CHECK(r.v[0] == 0x6627e8d5u);
    CHECK(r.v[1] == 0xe169c58du);
    CHECK(r.v[2] == 0xbc57ac4cu);
    CHECK(r.v[3] == 0x9b00dbd8u);
    r = ls::philox4x32_10(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
    CHECK(r.v[0] == 0x408f276du);
    CHECK(r.v[1] == 0x41c83b0eu);
    CHECK(r.v[2] == 0xa20bc7c6u);
    CHECK(r.v[3] == 0x6d5451fdu);
    r = ls::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
    CHECK(r.v[0] == 0xd16cfe09u);
    CHECK(r.v[1] == 0x94fdccebu);
    CHECK(r.v[2] == 0x5001e420u);
    CHECK(r.v[3] == 0x24126ea1u);
  }

  TEST_CASE("random values depend on (seed, purpose, index) only") {
    CHECK(ls::random_u32(1, ls::Purpose::kInit, 5) == ls::random_u32(1, ls::Purpose::kInit, 5));
    CHECK(ls::random_u32(1, ls::Purpose::kInit, 5) != ls::random_u32(1, ls::Purpose::kInit, 6));
    CHECK(ls::random_u32(1, ls::Purpose::kInit, 5) != ls::random_u32(1, ls::Purpose::kDataWindow, 5));
    CHECK(ls::random_u32(1, ls::Purpose::kInit, 5) != ls::random_u32(2, ls::Purpose::kInit, 5));
    for (uint64_t i = 0; i < 1000; ++i) {
      float u = ls::random_unit(9, ls::Purpose::kTest, i);
      CHECK((u >= 0.0f && u < 1.0f));
    }
  }

  TEST_CASE("bf16 is round-to-nearest-even of fp32") {
    CHECK(ls::to_bf16(1.0f) == 0x3f80);
    CHECK(ls::to_bf16(1.0f + 0x1p-8f) == 0x3f80);              // halfway, down to even
    CHECK(ls::to_bf16(1.0f + 0x1p-7f + 0x1p-8f) == 0x3f82);    // halfway, up to even
    CHECK(ls::to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);   // above halfway
    CHECK(ls::from_bf16(ls::to_bf16(-2.5f)) == -2.5f);
    CHECK(ls::to_bf16(-(1.0f + 0x1p-8f)) == 0xbf80);           // negative tie, to even
    CHECK(ls::to_bf16(-0.0f) == 0x8000);
    CHECK(ls::to_bf16(ls::from_bits(0x7f800000u)) == 0x7f80);   // +inf
    CHECK(ls::to_bf16(ls::from_bits(0xff800000u)) == 0xff80);   // -inf
    CHECK(ls::to_bf16(ls::from_bits(0x7f7fffffu)) == 0x7f80);   // max float rounds up to inf
    CHECK(ls::to_bf16(ls::from_bits(0x7f7f7fffu)) == 0x7f7f);   // below the tie: max bf16
    CHECK(ls::to_bf16(ls::from_bits(0x00008000u)) == 0x0000);   // subnormal tie, to even (+0)
    CHECK(ls::to_bf16(ls::from_bits(0x00018000u)) == 0x0002);   // subnormal tie, to even (up)
    CHECK(ls::to_bf16(ls::from_bits(0x007fffffu)) == 0x0080);   // largest subnormal up to 2^-126
    // NaN stays NaN and is quiet, sign and top payload kept; the rounding
    // add would have carried a low-payload NaN into inf.
    CHECK(ls::to_bf16(ls::from_bits(0x7f800001u)) == 0x7fc0);
    CHECK(ls::to_bf16(ls::from_bits(0xff810000u)) == 0xffc1);
    CHECK(ls::to_bf16(ls::from_bits(0x7fffffffu)) == 0x7fff);
  }

  // The bf16 fold by hand (contract_bf16.h; docs/NUMERICS.md "The bf16
  // fold"): each expected value is worked out here from the rule, not from
  // ls::bf16_dot. tests/test_gemm_bf16.cc holds the hardware and every GEMM
  // path to bf16_dot.
  TEST_CASE("bf16 fold: 32-k blocks, E and O apart, one rounding per step, +0 starts") {
    auto h = [](float x) { return ls::to_bf16(x); };
    const uint16_t one = h(1.0f), e24 = h(0x1p-24f), zero = 0, nzero = 0x8000;
    std::vector<uint16_t> ones(64, one);
    // Products 2^-24 (k = 0, E) and 2^-24 (k = 1, O) from 1: E + O = 2^-23
    // first, then 1 + 2^-23 exactly. Folded one by one onto 1 (the fp32
    // fold, or vdpbf16ps's pairs) each would be a tie back to 1.
    const uint16_t b[2] = {e24, e24};
    CHECK(ls::bf16_dot(b, 1, ones.data(), 1, 2, 1.0f) == 1.0f + 0x1p-23f);
    // Each step rounds: 1, 2^-24, 2^-24 in E (k = 0, 2, 4) is 1 (two ties to
    // even); one rounding of the exact sum would be 1 + 2^-23.
    const uint16_t c[5] = {one, zero, e24, zero, e24};
    CHECK(ls::bf16_dot(c, 1, ones.data(), 1, 5, 0.0f) == 1.0f);
    // Blocks: 1 at k = 0 and 2^-24 at k = 1 and 31 (both O of block 0) give
    // 1 + 2^-23; with the second 2^-24 at k = 33 (O of block 1), each block's
    // S is added to C on its own: 1 + 2^-24 ties to 1, twice.
    std::vector<uint16_t> d(34, zero);
    d[0] = one;
    d[1] = e24;
    d[31] = e24;
    CHECK(ls::bf16_dot(d.data(), 1, ones.data(), 1, 32, 0.0f) == 1.0f + 0x1p-23f);
    d[31] = zero;
    d[33] = e24;
    CHECK(ls::bf16_dot(d.data(), 1, ones.data(), 1, 34, 0.0f) == 1.0f);
    // Signed zeros: E and O start at +0, so -0 products give +0, and +0 + a
    // -0 start is +0; only E = O = -0 (flushed negative tinies, a full block:
    // a padding step's +0 + -0 is +0) with a -0 start stays -0.
    const uint16_t nz[2] = {nzero, nzero};
    const std::vector<uint16_t> tiny(32, h(-0x1p-100f)), u(32, h(0x1p-30f));
    CHECK(ls::bits(ls::bf16_dot(nz, 1, ones.data(), 1, 1, -0.0f)) == 0u);
    CHECK(ls::bits(ls::bf16_dot(nz, 1, ones.data(), 1, 2, -0.0f)) == 0u);
    CHECK(ls::bits(ls::bf16_dot(tiny.data(), 1, u.data(), 1, 32, -0.0f)) == 0x80000000u);
    CHECK(ls::bits(ls::bf16_dot(tiny.data(), 1, u.data(), 1, 32, 0.0f)) == 0u);
    CHECK(ls::bits(ls::bf16_dot(tiny.data(), 1, u.data(), 1, 31, -0.0f)) == 0u);  // padded
    // K = 0: the start untouched (not flushed, NaN payload kept).
    CHECK(ls::bits(ls::bf16_dot(b, 1, ones.data(), 1, 0, ls::from_bits(0x7fc12345u))) == 0x7fc12345u);
    // Stride: a column of a row-major 2 x 2.
    const uint16_t w[4] = {h(3.0f), h(5.0f), h(2.0f), h(7.0f)}, x[2] = {h(0.5f), h(0.25f)};
    CHECK(ls::bf16_dot(x, 1, w + 1, 2, 2, 0.0f) == 0.25f * 7.0f + 0.5f * 5.0f);
  }

  TEST_CASE("bf16 fold: denormals flushed in (DAZ) and out (FTZ), tininess after rounding") {
    auto h = [](float x) { return ls::to_bf16(x); };
    const uint16_t zero = 0, m63 = h(0x1p-63f);
    // DAZ on inputs: a bf16 subnormal (2^-133) times 2^100 counts as 0, not 2^-33.
    const uint16_t den[1] = {0x0001}, big[1] = {h(0x1p100f)};
    CHECK(ls::bits(ls::bf16_dot(den, 1, big, 1, 1, 0.0f)) == 0u);
    // DAZ on the start: 2^-127 counts as +0, so + 2^-126 (S, from the k = 1
    // product) gives 2^-126, not 1.5 * 2^-126.
    const uint16_t p[2] = {zero, m63};
    CHECK(ls::bf16_dot(p, 1, p, 1, 2, 0x1p-127f) == 0x1p-126f);
    // FTZ on a step: two 2^-127 products (E, O) are each flushed: 0, not 2^-126.
    const uint16_t q[2] = {m63, m63}, q2[2] = {h(0x1p-64f), h(0x1p-64f)};
    CHECK(ls::bits(ls::bf16_dot(q, 1, q2, 1, 2, 0.0f)) == 0u);
    // A tiny addend joins a normal E unflushed: 2^-125 + 2^-127.
    const uint16_t r[3] = {h(0x1p-62f), zero, m63}, r2[3] = {m63, zero, h(0x1p-64f)};
    CHECK(ls::bf16_dot(r, 1, r2, 1, 3, 0.0f) == 0x1.4p-125f);
    // FTZ on an add: E = 2^-126, O = -1.5 * 2^-126, S = -2^-127 (exact) is
    // flushed to -0; -0 + a -0 start stays -0. The C add likewise:
    // 1.5 * 2^-126 - 2^-126 = 2^-127 gives +0.
    const uint16_t s[2] = {m63, h(-0x1.8p-63f)}, s2[2] = {m63, m63};
    CHECK(ls::bits(ls::bf16_dot(s, 1, s2, 1, 2, -0.0f)) == 0x80000000u);
    const uint16_t v[2] = {h(-0x1p-63f), zero}, vv[2] = {m63, zero};
    CHECK(ls::bits(ls::bf16_dot(v, 1, vv, 1, 2, 0x1.8p-126f)) == 0u);
    // At the boundary, in E (k = 0 then 2): 2^-126 - 2^-150 is a 24-bit value
    // below 2^-126, so it flushes, although fma rounds it (on the subnormal
    // grid, a tie) up to 2^-126. 2^-126 - 2^-151 rounds to 2^-126 at 24 bits.
    const uint16_t a75[3] = {m63, zero, h(0x1p-75f)}, n75[3] = {m63, zero, h(-0x1p-75f)};
    const uint16_t n76[3] = {m63, zero, h(-0x1p-76f)};
    CHECK(ls::fma(0x1p-75f, -0x1p-75f, 0x1p-126f) == 0x1p-126f);
    CHECK(ls::bits(ls::bf16_dot(a75, 1, n75, 1, 3, 0.0f)) == 0u);
    CHECK(ls::bf16_dot(a75, 1, n76, 1, 3, 0.0f) == 0x1p-126f);
    // Between the two: 2^-126 - 2^-150 + 2^-158 rounds at 24 bits to
    // 2^-126 - 2^-150 (tiny, flushed).
    const uint16_t c63[3] = {m63, zero, m63}, c88[3] = {m63, zero, h(-0x1.fep-88f)};
    CHECK(ls::bits(ls::bf16_dot(c63, 1, c88, 1, 3, 0.0f)) == 0u);
    // Not tiny: 2^-126 plus a product below its ulp stays 2^-126.
    const uint16_t t[3] = {m63, zero, h(-0x1p-125f)}, t2[3] = {m63, zero, h(0x1p-125f)};
    CHECK(ls::bf16_dot(t, 1, t2, 1, 3, 0.0f) == 0x1p-126f);
  }

  TEST_CASE("bf16 fold: infinities, and every NaN result is 0x7fc00000") {
    auto h = [](float x) { return ls::to_bf16(x); };
    const uint16_t inf = 0x7f80, ninf = 0xff80, one = h(1.0f), zero = 0;
    const uint16_t ones[2] = {one, one};
    const uint16_t i1[2] = {inf, one};
    CHECK(ls::bits(ls::bf16_dot(i1, 1, ones, 1, 2, 0.0f)) == 0x7f800000u);
    const uint16_t ii[2] = {inf, ninf};  // inf - inf
    CHECK(ls::bits(ls::bf16_dot(ii, 1, ones, 1, 2, 0.0f)) == 0x7fc00000u);
    const uint16_t iz[1] = {ninf}, z[1] = {zero};  // -inf * 0
    CHECK(ls::bits(ls::bf16_dot(iz, 1, z, 1, 1, 0.0f)) == 0x7fc00000u);
    const uint16_t nan[2] = {0xffc1, one};  // an input NaN's sign and payload are not passed on
    CHECK(ls::bits(ls::bf16_dot(nan, 1, ones, 1, 2, 0.0f)) == 0x7fc00000u);
    CHECK(ls::bits(ls::bf16_dot(ones, 1, ones, 1, 2, ls::from_bits(0xffc12345u))) == 0x7fc00000u);
    // Overflow: max bf16 squared is inf.
    const uint16_t mx[1] = {0x7f7f};
    CHECK(ls::bits(ls::bf16_dot(mx, 1, mx, 1, 1, 0.0f)) == 0x7f800000u);
  }

  TEST_CASE("state hash: XXH3-128 over the documented serialization") {
    const float a[3] = {1.0f, -2.0f, 0.5f}, b[2] = {3.0f, 4.0f};
    ls::StateHasher h;
    h.add("alpha", {3}, a);
    h.add("beta", {1, 2}, b);
    // Independent path: build the byte stream by hand and hash it in one call.
    std::vector<unsigned char> bytes;
    auto u32 = [&](uint32_t v) { for (int i = 0; i < 4; ++i) bytes.push_back((unsigned char)(v >> (8 * i))); };
    auto u64 = [&](uint64_t v) { u32((uint32_t)v); u32((uint32_t)(v >> 32)); };
    auto tensor = [&](const char* name, std::vector<uint64_t> dims, const float* d, size_t n) {
      u32((uint32_t)std::strlen(name));
      bytes.insert(bytes.end(), name, name + std::strlen(name));
      u32((uint32_t)dims.size());
      for (uint64_t x : dims) u64(x);
      for (size_t i = 0; i < n; ++i) u32(ls::bits(d[i]));
    };
    tensor("alpha", {3}, a, 3);
    tensor("beta", {1, 2}, b, 2);
    XXH128_hash_t want = XXH3_128bits(bytes.data(), bytes.size());
    char hex[33];
    std::snprintf(hex, sizeof hex, "%016llx%016llx", (unsigned long long)want.high64, (unsigned long long)want.low64);
    CHECK(h.hex() == hex);

    ls::StateHasher reshaped;  // same bits, other shape: another state
    reshaped.add("alpha", {3}, a);
    reshaped.add("beta", {2}, b);
    CHECK(reshaped.hex() != h.hex());

    ls::StateHasher out_of_order;
    out_of_order.add("beta", {2}, b);
    CHECK_THROWS_AS(out_of_order.add("alpha", {3}, a), std::logic_error);
  }

  TEST_CASE("init_uniform: bounded, deterministic, keyed by tensor name") {
    const uint32_t id = ls::tensor_id("layers.0.wqkv");
    CHECK(id == ls::tensor_id("layers.0.wqkv"));
    CHECK(id != ls::tensor_id("layers.0.wo"));
    const float a = 0.02f * ls::sqrt(3.0f);
    for (uint64_t i = 0; i < 1000; ++i) {
      float w = ls::init_uniform(5, id, i, 0.02f);
      CHECK((w >= -a && w < a));
    }
  }
}
