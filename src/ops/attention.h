// Causal self-attention of one (sample, head), forward and backward: the
// engine twin of ref::attention_head / ref::attention_head_backward.
//
// The probabilities P are kept in a blocked layout: query positions t in
// blocks of 16, each block holding S rows (key position u) of 16 lanes
// (t % 16). A block's softmax then runs over u with the 16 queries side by
// side in vector lanes, each lane its own sequential fold.
#pragma once

#include <cstdint>
#include <vector>

namespace ls::ops {

// Scratch reused across calls by one thread.
struct AttentionScratch {
  std::vector<float> t0, t1;
};

// Floats of P for a sequence of S positions.
int64_t attention_probs_floats(int S);
// P(t, u) for u <= t (entries with u > t hold zeros or are never written).
float attention_prob(const float* P, int S, int t, int u);

// q, k, v rows have stride ld; o has stride ldo; P holds attention_probs_floats(S).
// Scores reduce over the head feature j; outputs over the key position u <= t.
void attention_forward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                       float* P, float* o, int64_t ldo, AttentionScratch& scratch);

// dq reduces over u <= t; dk and dv over the query position t' >= u, folded
// in ascending t'. dq, dk, dv have stride ldd.
void attention_backward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                        const float* P, const float* dO, int64_t ldo, float* dq, float* dk, float* dv, int64_t ldd,
                        AttentionScratch& scratch);

// Every (sample, head) of a batch in the model's layout: q, k, v of head h
// of sample b are rows b*S.. of qkv [B*S, 3D] at columns h*hd, D + h*hd and
// 2D + h*hd (D = H*hd); head b*H + h keeps its P at P + (b*H + h) *
// attention_probs_floats(S); o and dO are [B*S, D] at columns h*hd. Heads in
// parallel, each as attention_forward / attention_backward (one kernel
// launch for all of them on a kernel backend).
void attention_forward_heads(const float* qkv, int B, int H, int S, int hd, float scale, float* P, float* o);
void attention_backward_heads(const float* qkv, int B, int H, int S, int hd, float scale, const float* P,
                              const float* dO, float* dqkv);

}  // namespace ls::ops
