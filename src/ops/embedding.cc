#include "ops/ops.h"

#include <algorithm>
#include <vector>

#include "common/parallel.h"
#include "contract.h"
#include "ops/dispatch.h"

namespace ls::ops {

void embed(const int* tok, const float* te, const float* pe, float* h, int64_t N, int S, int D) {
  if (auto k = kernel(&OpHooks::embed)) return k(tok, te, pe, h, N, S, D);
  parallel_for(N, [&](int64_t n) { for (int i = 0; i < D; ++i) h[n * D + i] = te[(int64_t)tok[n] * D + i] + pe[(n % S) * D + i]; });
}

// Embedding gradients: per leaf, fold dh of the tokens with that byte (or
// position) in token order with plain adds; leaves by the canonical tree.
// Tasks own blocks of 16 rows (bytes or positions), each with its own leaf
// tree: a row's fold does not depend on the block that holds it.
//
// Most bytes are absent from most leaves. A row's leaf value is a fold of
// adds from +0, so never -0, and so neither is any sum of such values; +0
// is then an exact identity in every add of the tree. Each stack entry
// keeps a mask of the rows that are not +0, and only those are zeroed,
// added and merged: the canonical tree's bits, without its zero rows.
void embedding_grad(const int* tok_id, const float* dh, int64_t N, int S, int D, int V, int64_t leaf_tokens,
                    int64_t leaves, float* gtok, float* gpos) {
  if (auto k = kernel(&OpHooks::embedding_grad)) return k(tok_id, dh, N, S, D, V, leaf_tokens, leaves, gtok, gpos);
  {
    constexpr int64_t kRows = 16;
    const int64_t tok_blocks = (V + kRows - 1) / kRows, pos_blocks = (S + kRows - 1) / kRows;
    parallel_tasks_with<std::vector<float>>(tok_blocks + pos_blocks, [&](std::vector<float>& scratch, int64_t t) {
      const bool by_token = t < tok_blocks;
      const int64_t r0 = (by_token ? t : t - tok_blocks) * kRows;
      const int64_t rows = std::min(kRows, (by_token ? V : S) - r0), width = rows * D;
      scratch.resize((size_t)LeafTree::levels_for(leaves) * width);
      uint32_t mask[64];  // rows of each stack entry that are not +0
      LeafTree tree(scratch.data(), width);  // the canonical tree's schedule; merges are merge() below
      // left += right over the rows right holds: a row only right holds is
      // copied (0 + x is x), one only left holds stays (x + 0 is x).
      auto merge = [&](int d) {
        float *left = &scratch[(size_t)d * width], *right = left + width;
        for (uint32_t m = mask[d + 1]; m; m &= m - 1) {
          const int64_t row = __builtin_ctz(m);
          float *l = left + row * D, *r = right + row * D;
          if (mask[d] >> row & 1)
            for (int i = 0; i < D; ++i) l[i] = l[i] + r[i];
          else
            std::copy(r, r + D, l);
        }
        mask[d] |= mask[d + 1];
      };
      for (int64_t lf = 0; lf < leaves; ++lf) {
        float* acc = tree.next_leaf();
        uint32_t touched = 0;
        // Each row takes its tokens in ascending order, from +0.
        auto add_token = [&](int64_t n, int64_t row) {
          float* dst = acc + row * D;
          if (!(touched >> row & 1)) {
            std::fill(dst, dst + D, 0.0f);
            touched |= 1u << row;
          }
          const float* src = &dh[n * D];
          for (int i = 0; i < D; ++i) dst[i] = dst[i] + src[i];
        };
        if (by_token) {
          for (int64_t n = lf * leaf_tokens; n < (lf + 1) * leaf_tokens; ++n)
            if (tok_id[n] >= r0 && tok_id[n] < r0 + rows) add_token(n, tok_id[n] - r0);
        } else {  // a leaf is whole samples: position p is token s0 + p of each
          for (int64_t s0 = lf * leaf_tokens; s0 < (lf + 1) * leaf_tokens; s0 += S)
            for (int64_t row = 0; row < rows; ++row) add_token(s0 + r0 + row, row);
        }
        mask[tree.depth] = touched;
        tree.push_with(merge);
      }
      tree.finish_with(merge);  // no leaves give +0 (below)
      float* out = (by_token ? gtok : gpos) + r0 * D;
      for (int64_t row = 0; row < rows; ++row) {
        const float* sum = &scratch[(size_t)row * D];
        if (tree.depth > 0 && (mask[0] >> row & 1)) std::copy(sum, sum + D, out + row * D);
        else std::fill(out + row * D, out + (row + 1) * D, 0.0f);
      }
    });
  }
}

}  // namespace ls::ops
