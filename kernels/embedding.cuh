// The embedding and its gradients as CUDA kernels, the bits of ops::embed and
// ops::embedding_grad. The gradient is a scatter-add by token id, done as a
// reduction over the token index: one thread per (byte or position, feature)
// element runs its own leaf tree, each leaf adding the leaf's matching tokens
// in ascending order from +0 (a leaf without the byte is +0). No atomics: a
// thread reads every token of a leaf and keeps the ones that are its byte.
#pragma once

#include <cstdint>

#include "contract.h"

namespace ls::kernels {

// h[n] = te[tok[n]] + pe[n % S], one thread per token.
__global__ void embed(const int* tok, const float* te, const float* pe, float* h, int64_t N, int S, int D) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  for (int i = 0; i < D; ++i) h[n * D + i] = te[(int64_t)tok[n] * D + i] + pe[(n % S) * D + i];
}

// Thread e of (V + S) * D: rows 0..V-1 are bytes (gtok), V..V+S-1 positions (gpos).
__global__ void embedding_grad(const int* tok, const float* dh, int64_t N, int S, int D, int V, int64_t leaf_tokens,
                               int64_t leaves, float* gtok, float* gpos) {
  const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  (void)N;  // = leaves * leaf_tokens: the leaves cover every token
  if (e >= (int64_t)(V + S) * D) return;
  const int64_t row = e / D;
  const int i = (int)(e % D);
  const bool by_token = row < V;
  float stack[64];
  ls::LeafTree tree(stack, 1);
  for (int64_t lf = 0; lf < leaves; ++lf) {
    float acc = 0.0f;
    if (by_token) {
      for (int64_t n = lf * leaf_tokens; n < (lf + 1) * leaf_tokens; ++n)
        if (tok[n] == row) acc = acc + dh[n * D + i];
    } else {  // position p = row - V of every sample of the leaf, samples ascending
      for (int64_t s0 = lf * leaf_tokens; s0 < (lf + 1) * leaf_tokens; s0 += S) acc = acc + dh[(s0 + row - V) * D + i];
    }
    *tree.next_leaf() = acc;
    tree.push();
  }
  (by_token ? gtok + row * D : gpos + (row - V) * D)[i] = *tree.finish();
}

}  // namespace ls::kernels
