// Causal self-attention of one (sample, head), forward and backward: the
// engine twin of ref::attention_head / ref::attention_head_backward.
#pragma once

#include <cstdint>
#include <vector>

namespace ls::ops {

// Scratch reused across calls by one thread.
struct AttentionScratch {
  std::vector<float> t0, t1, t2;
};

// q, k, v rows have stride ld; P is S x S (row t holds u <= t); o has stride ldo.
// Scores reduce over the head feature j; outputs over the key position u <= t.
void attention_forward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                       float* P, float* o, int64_t ldo, AttentionScratch& scratch);

// dq reduces over u <= t; dk and dv over the query position t' >= u, folded
// in ascending t'. dq, dk, dv have stride ldd.
void attention_backward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                        const float* P, const float* dO, int64_t ldo, float* dq, float* dk, float* dv, int64_t ldd,
                        AttentionScratch& scratch);

}  // namespace ls::ops
