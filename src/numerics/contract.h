// The numerics contract: the one header shared by the engine, the reference
// and the CUDA kernels. Everything here is a function of logical indices only.
// docs/NUMERICS.md states the rules; this header is their executable form.
//
// Rules in short:
//  1. binary32, round-to-nearest-even; only + - * / sqrt and explicit fma
//     (ls::fma). Built with -ffp-contract=off (nvcc: -fmad=false), no FTZ.
//  2. exp/log/tanh/sigmoid/sin/cos are ours (contract_math.h), built from (1).
//  3. Feature reductions: one sequential fma fold over the index, from +0.
//     Token reductions: a sequential fold inside each leaf of
//     `leaf_samples` consecutive samples, leaves combined by the canonical
//     tree (tree_split below). Parameter reductions: blocks of
//     kParamBlock elements, same canonical tree over block index.
//  4. Discrete choices break ties by the lowest index.
//  5. Randomness: Philox4x32-10 keyed by (seed, purpose, logical index).
//  6. State hash: XXH3-128 over the canonical serialization (StateHasher).
//  7. bf16 (contract_bf16.h): ls::to_bf16 rounds to nearest even; the bf16
//     fold over k is AMX TDPBF16PS's order (32-k blocks, even and odd k
//     in two accumulators) with its flushing, emulated.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define LS_HD __host__ __device__ __forceinline__
#else
#define LS_HD inline
#endif

namespace ls {

// ---------------------------------------------------------------- bits ----
LS_HD uint32_t bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
#endif
}
LS_HD float from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, 4);
  return x;
#endif
}

// The only fused operation: fma where the contract says fma, nowhere else.
LS_HD float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}
LS_HD float sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return __builtin_sqrtf(x);
#endif
}

// ------------------------------------------------------- reduction tree ----
// Contract constants.
constexpr int kParamBlock = 1024;  // parameter-index reductions: block size

// The canonical tree over n >= 2 ordered leaves: the left subtree holds the
// largest power of two strictly below n, the right subtree the rest.
// A binary counter that pushes leaves left to right and, at the end, folds
// its stack right to left builds exactly this tree (LeafTree below).
LS_HD int64_t tree_split(int64_t n) {
  int64_t p = 1;
  while (p * 2 < n) p *= 2;
  return p;
}

// Sum of n scalars by the canonical tree (leaves are the values themselves).
LS_HD float tree_sum(const float* v, int64_t n) {
  if (n <= 0) return 0.0f;
  if (n == 1) return v[0];
  int64_t p = tree_split(n);
  return tree_sum(v, p) + tree_sum(v + p, n - p);
}

// Sum of squares of n parameters: fma fold inside blocks of kParamBlock from
// +0, blocks combined by the canonical tree over block index.
LS_HD float sumsq_block(const float* v, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc = ls::fma(v[i], v[i], acc);
  return acc;
}
LS_HD float param_sumsq(const float* v, int64_t n) {
  if (n <= kParamBlock) return sumsq_block(v, n);
  int64_t blocks = (n + kParamBlock - 1) / kParamBlock;
  int64_t p = tree_split(blocks) * kParamBlock;
  return param_sumsq(v, p) + param_sumsq(v + p, n - p);
}

// Binary-counter accumulator for the canonical leaf tree over vectors of
// `width` floats, using O(log leaves) buffers. Storage is caller-provided
// scratch of (levels * width) floats; push leaves in leaf order, then
// finish(). Used for every reduction over tokens (weight gradients, loss).
struct LeafTree {
  float* slots;  // levels * width scratch
  int64_t width;
  int64_t pushed = 0;  // leaves so far
  int depth = 0;

  LS_HD LeafTree(float* scratch, int64_t w) : slots(scratch), width(w) {}
  // Merges (left + right) that pushing leaf `index` (from 0) makes: every
  // entry of the stack holds a power-of-two count of leaves, so the stack
  // spells index in binary and the new leaf merges with as many entries as
  // index has trailing ones. For kernels that run this tree themselves.
  LS_HD static int merges_on_push(int64_t index) {
#if defined(__CUDA_ARCH__)
    return __ffsll(~(long long)index) - 1;
#else
    return __builtin_ctzll(~(uint64_t)index);
#endif
  }
  // Returns the buffer the next leaf must be written into (width floats).
  LS_HD float* next_leaf() { return slots + (int64_t)depth * width; }
  // The tree's schedule with the caller's merge: merge(d) must set stack
  // entry d = entry d + entry d+1 (left + right). For callers whose entries
  // live elsewhere or merge another way (on a device, or rows kept sparse).
  // push_with commits leaf `pushed`; finish_with folds the stack right to
  // left into entry 0 (with no leaves pushed there is no entry: the caller's
  // +0).
  template <class Merge>
  LS_HD void push_with(Merge&& merge) {
    ++depth;
    for (int m = merges_on_push(pushed++); m > 0; --m) {
      --depth;
      merge(depth - 1);
    }
  }
  template <class Merge>
  LS_HD void finish_with(Merge&& merge) {
    for (int d = depth - 2; d >= 0; --d) merge(d);
    if (depth > 1) depth = 1;
  }
  // left = left + right over this tree's entries of `width` floats.
  struct AddEntries {
    float* slots;
    int64_t width;
    LS_HD void operator()(int d) const {
      float* l = slots + (int64_t)d * width;
      const float* r = l + width;
      for (int64_t i = 0; i < width; ++i) l[i] = l[i] + r[i];
    }
  };
  // Commits the leaf written into next_leaf(); merges equal-sized subtrees.
  LS_HD void push() { push_with(AddEntries{slots, width}); }
  // Folds the remaining stack right to left into slot 0; returns it.
  // With no leaves pushed the result is +0.
  LS_HD float* finish() {
    if (depth == 0) {
      for (int64_t i = 0; i < width; ++i) slots[i] = 0.0f;
      return slots;
    }
    finish_with(AddEntries{slots, width});
    return slots;
  }
  // Scratch levels needed for n leaves.
  LS_HD static int levels_for(int64_t n) {
    int l = 1;
    while ((int64_t(1) << (l - 1)) < n) ++l;
    return l + 1;
  }
};

// ------------------------------------------------------ discrete choices ----
// Top-k routing of one token (rule 4): sel[s] = the s-th largest of E gates
// (E <= 256) among those not yet taken, by a scan in ascending e with a
// strict >, so ties go to the lowest index. The scan `if (free && (best < 0
// || g[e] > g[best])) best = e` with selects instead of branches (gates are
// data: branches mispredict). The engine's op and the routing kernel both
// run this.
LS_HD void topk_lowest_index(const float* g, int E, int K, int* sel) {
  uint64_t taken[4] = {0, 0, 0, 0};
  for (int s = 0; s < K; ++s) {
    int best = -1;
    float best_g = 0.0f;
    for (int e = 0; e < E; ++e) {
      const bool take = !((taken[e >> 6] >> (e & 63)) & 1) && (best < 0 || g[e] > best_g);
      best = take ? e : best;
      best_g = take ? g[e] : best_g;
    }
    taken[best >> 6] |= 1ull << (best & 63);
    sel[s] = best;
  }
}

// --------------------------------------------------------------- Philox ----
// Philox4x32-10 (Salmon et al., SC'11). Key = seed; counter = (index lo,
// index hi, purpose, 0). A value depends only on (seed, purpose, index).
struct U32x4 { uint32_t v[4]; };

LS_HD U32x4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                          uint32_t k0, uint32_t k1) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  const uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = (uint64_t)M0 * c0, p1 = (uint64_t)M1 * c2;
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += W0; k1 += W1;
  }
  U32x4 out = {{c0, c1, c2, c3}};
  return out;
}

// Purposes: one per independent random stream. Never reuse a value.
enum class Purpose : uint32_t {
  kInit = 1,       // parameter init; index = (tensor id << 40) | element
  kDataWindow = 2, // training window start; index = step * batch + sample
  kEvalWindow = 3, // held-out windows; index = eval sample
  kCorpus = 4,     // synthetic corpus generation
  kTest = 99,
};

LS_HD U32x4 philox(uint64_t seed, Purpose purpose, uint64_t index) {
  return philox4x32_10((uint32_t)index, (uint32_t)(index >> 32), (uint32_t)purpose, 0u,
                       (uint32_t)seed, (uint32_t)(seed >> 32));
}
LS_HD uint32_t random_u32(uint64_t seed, Purpose purpose, uint64_t index) {
  return philox(seed, purpose, index).v[0];
}
LS_HD uint64_t random_u64(uint64_t seed, Purpose purpose, uint64_t index) {
  U32x4 r = philox(seed, purpose, index);
  return ((uint64_t)r.v[1] << 32) | r.v[0];
}
// Uniform in [0, 1): top 24 bits, exact in binary32.
LS_HD float random_unit(uint64_t seed, Purpose purpose, uint64_t index) {
  return (float)(random_u32(seed, purpose, index) >> 8) * (1.0f / 16777216.0f);
}
// Uniform in [-a, a): 2a*u - a.
LS_HD float random_symmetric(uint64_t seed, Purpose purpose, uint64_t index, float a) {
  float u = random_unit(seed, purpose, index);
  return (2.0f * a) * u - a;
}

// Parameter init (contract rule 5): element i of the tensor named `name` is
// uniform in [-a, a), a = std * sqrt(3), drawn at logical index
// (tensor_id(name) << 40) | i, with tensor_id the 24-bit FNV-1a of the name.
LS_HD uint32_t tensor_id(const char* name) {
  uint32_t h = 2166136261u;
  for (; *name; ++name) h = (h ^ (unsigned char)*name) * 16777619u;
  return h & 0xffffffu;
}
LS_HD float init_uniform(uint64_t seed, uint32_t id, uint64_t i, float std) {
  const float a = std * ls::sqrt(3.0f);
  return random_symmetric(seed, Purpose::kInit, ((uint64_t)id << 40) | i, a);
}

}  // namespace ls

#include "contract_math.h"
#include "contract_bf16.h"  // ls::to_bf16 and the bf16 fold

#if !defined(__CUDA_ARCH__)
#include "contract_hash.h"
#endif
