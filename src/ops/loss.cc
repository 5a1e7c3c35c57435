// Token losses, their gradient, and the router's aux and z-loss terms.
#include "ops/ops.h"

#include <vector>

#include "common/numerics_level.h"
#include "common/parallel.h"
#include "contract.h"
#include "ops/dispatch.h"
#include "ops/local.h"

namespace ls::ops {

float token_sum(const float* v, int64_t N, int64_t leaf_tokens) {
  if (auto k = kernel(&OpHooks::token_sum)) return k(v, N, leaf_tokens);
  if (local_numerics()) return local::token_sum(v, N);
  const int64_t leaves = N / leaf_tokens;
  std::vector<float> part((size_t)leaves);
  for (int64_t l = 0; l < leaves; ++l) {
    float acc = 0.0f;
    for (int64_t n = l * leaf_tokens; n < (l + 1) * leaf_tokens; ++n) acc = acc + v[n];
    part[(size_t)l] = acc;
  }
  return tree_sum(part.data(), leaves);
}

void router_stats(const float* g, const float* lse, int64_t N, int E, int64_t leaf_tokens, int64_t leaves,
                  float* sums) {
  if (auto k = kernel(&OpHooks::router_stats)) return k(g, lse, N, E, leaf_tokens, leaves, sums);
  (void)N;  // = leaves * leaf_tokens
  std::vector<float> part((size_t)leaves * E), zpart(leaves);
  for (int64_t lf = 0; lf < leaves; ++lf) {
    float* acc = &part[(size_t)lf * E];
    float zacc = 0.0f;
    for (int64_t n = lf * leaf_tokens; n < (lf + 1) * leaf_tokens; ++n) {
      for (int e = 0; e < E; ++e) acc[e] = acc[e] + g[n * E + e];
      zacc = ls::fma(lse[n], lse[n], zacc);
    }
    zpart[lf] = zacc;
  }
  std::vector<float> col(leaves);
  for (int e = 0; e < E; ++e) {
    for (int64_t lf = 0; lf < leaves; ++lf) col[lf] = part[(size_t)lf * E + e];
    sums[e] = tree_sum(col.data(), leaves);
  }
  sums[E] = tree_sum(zpart.data(), leaves);
}

void token_losses(const float* lse, const float* logits, const int* target, int64_t N, int V, float* loss) {
  if (auto k = kernel(&OpHooks::token_losses)) return k(lse, logits, target, N, V, loss);
  for (int64_t n = 0; n < N; ++n) loss[n] = lse[n] - logits[n * V + target[n]];
}

void cross_entropy_grad(const float* prob, const int* target, int64_t N, int V, float Ng, float* dlogits) {
  if (auto k = kernel(&OpHooks::cross_entropy_grad)) return k(prob, target, N, V, Ng, dlogits);
  // Dividing by a power of two is scaling by its exact reciprocal: both round
  // the same real number once, so the bits agree (subnormals included), and a
  // multiply is several times cheaper than a divide.
  const bool ng_pow2 = (ls::bits(Ng) & 0x007fffffu) == 0 && Ng >= 1.0f && Ng <= 0x1p126f;
  parallel_for(N, [&](int64_t n) {
    const int y = target[n];
    const float ng = Ng, inv = 1.0f / Ng;  // locals, so the stores below cannot alias them
    float* __restrict dl = &dlogits[n * V];
    const float* __restrict pr = &prob[n * V];
    // (p - onehot) / Ng; p - 0 is p itself (also for -0), so only the target subtracts.
    if (ng_pow2)
      for (int v = 0; v < V; ++v) dl[v] = pr[v] * inv;
    else
      for (int v = 0; v < V; ++v) dl[v] = pr[v] / ng;
    dl[y] = (pr[y] - 1.0f) / ng;
  });
}

void z_loss_grad(const float* g, const float* lse, int64_t N, int E, float two_zw, float Ng, float* dz) {
  if (auto k = kernel(&OpHooks::z_loss_grad)) return k(g, lse, N, E, two_zw, Ng, dz);
  for (int64_t n = 0; n < N; ++n) {
    const float zc = (two_zw * lse[n]) / Ng;
    for (int e = 0; e < E; ++e) dz[n * E + e] = dz[n * E + e] + zc * g[n * E + e];
  }
}

}  // namespace ls::ops
