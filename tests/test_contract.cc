// The numerics contract itself: compiler contraction is off, the canonical
// tree, Philox known answers, bf16 rounding, the state hash serialization.
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
