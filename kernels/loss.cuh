// The loss as CUDA kernels, the bits of ops::token_losses,
// ops::cross_entropy_grad and ops::token_sum: per-token cross-entropy and its
// gradient (elementwise, one thread per token), and the sum over tokens
// (reduces over the token index: one thread per leaf folds its tokens in
// order from +0, then the canonical tree over leaves in one thread).
#pragma once

#include <cstdint>

#include "contract.h"

namespace ls::kernels {

__global__ void token_losses(const float* lse, const float* logits, const int* target, int64_t N, int V, float* loss) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  loss[n] = lse[n] - logits[n * V + target[n]];
}

// (p - onehot) / Ng; by the exact reciprocal when Ng is a power of two (the
// same real number rounded once: the same bits, as the engine does it).
__global__ void cross_entropy_grad(const float* prob, const int* target, int64_t N, int V, float Ng, float* dlogits) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const bool ng_pow2 = (ls::bits(Ng) & 0x007fffffu) == 0 && Ng >= 1.0f && Ng <= 0x1p126f;
  const float inv = 1.0f / Ng;
  const float* pr = prob + n * V;
  float* dl = dlogits + n * V;
  for (int v = 0; v < V; ++v) dl[v] = ng_pow2 ? pr[v] * inv : pr[v] / Ng;
  const int y = target[n];
  dl[y] = (pr[y] - 1.0f) / Ng;
}

__global__ void leaf_sums(const float* v, int64_t leaves, int64_t leaf_tokens, float* part) {
  const int64_t l = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (l >= leaves) return;
  float acc = 0.0f;
  for (int64_t n = l * leaf_tokens; n < (l + 1) * leaf_tokens; ++n) acc = acc + v[n];
  part[l] = acc;
}

// Router statistics (ops::router_stats): thread e < E sums the gates of
// expert e, thread E the squared log-sum-exps; each folds its leaves' tokens
// in order from +0 and runs its own canonical tree over the leaves.
__global__ void router_stats(const float* g, const float* lse, int E, int64_t leaf_tokens, int64_t leaves,
                             float* sums) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e > E) return;
  float stack[64];
  ls::LeafTree tree(stack, 1);
  for (int64_t lf = 0; lf < leaves; ++lf) {
    float acc = 0.0f;
    for (int64_t n = lf * leaf_tokens; n < (lf + 1) * leaf_tokens; ++n)
      acc = e < E ? acc + g[n * E + e] : ls::fma(lse[n], lse[n], acc);
    *tree.next_leaf() = acc;
    tree.push();
  }
  sums[e] = *tree.finish();
}

}  // namespace ls::kernels
