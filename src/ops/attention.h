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
  std::vector<float> t0, t1, probs;
};

// Where a batch's P is kept between the forward and the backward: fp32
// entries, or bf16 ones. numerics.precision=bf16 rounds every entry of P to
// bf16 (ls::to_bf16) on every backend, so 16 bits hold the same values in
// half the bytes; the CPU engine keeps them so (kernel backends keep fp32).
// The layout is the same either way; strides and offsets count entries.
// The forward writes a ProbsStore; the backward reads a ProbsView, the same
// pointers read-only (a store converts to its view).
struct ProbsView {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
};
struct ProbsStore {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  operator ProbsView() const { return {f32, bf16}; }
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

// A query range: the positions t = t_off .. t_off+Q-1 of one sequence
// (local rows i = t - t_off) against its keys u = 0 .. t_off+Q-1 -- what a
// context-parallel rank computes for the queries it holds (mesh.cp,
// docs/NUMERICS.md §3). Every fold is the whole sequence's, so a row's
// outputs are the bits attention_forward / attention_backward give it.
// q, dO, o and dq hold the Q local rows (strides ldq, ldo, ldo, lddq); k, v
// hold the t_off + Q keys (stride ldkv); P the range's blocked probabilities.
int64_t attention_range_probs_floats(int Q, int t_off);
float attention_range_prob(const float* P, int Q, int t_off, int i, int u);

// Scores reduce over the head feature j; outputs over the key position u <= t.
void attention_forward_range(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q,
                             int t_off, int hd, float scale, float* P, float* o, int64_t ldo,
                             AttentionScratch& scratch);

// dq reduces over u <= t. dk and dv (t_off + Q rows, stride lddkv) reduce
// over the query position t >= u in ascending t: the range folds its
// queries into each key's row, from +0 or, with continue_kv, continuing the
// partial fold the row holds (the queries before t_off, folded by whoever
// held them). A key u >= t_off takes its first term here: its row must hold
// +0 when continuing. Chaining ranges in ascending t_off gives the whole
// sequence's dk, dv bit for bit.
void attention_backward_range(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldkv, int Q,
                              int t_off, int hd, float scale, const float* P, const float* dO, int64_t ldo,
                              float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv, bool continue_kv,
                              AttentionScratch& scratch);

// The _heads functions below run a bf16 store a chunk of kProbsChunk queries at a time (each chunk one query
// range, so every row's bits are the whole sequence's), keeping only a chunk's P in fp32 at once.
constexpr int kProbsChunk = 128;

// Every (sample, head) of a batch in the model's layout: q, k, v of head h
// of sample b are rows b*S.. of qkv [B*S, 3D] at columns h*hd, D + h*hd and
// 2D + h*hd (D = H*hd); head b*H + h keeps its P at P + (b*H + h) *
// attention_probs_floats(S); o and dO are [B*S, D] at columns h*hd. Heads in
// parallel, each as attention_forward / attention_backward (one kernel
// launch for all of them on a kernel backend).
void attention_forward_heads(const float* qkv, int B, int H, int S, int hd, float scale, ProbsStore P, float* o);
void attention_backward_heads(const float* qkv, int B, int H, int S, int hd, float scale, ProbsView P,
                              const float* dO, float* dqkv);

// Context parallel, in the model's layout (as the _heads functions above):
// the query range [first, first + count) of every (sample, head) of a batch;
// head bh keeps the range's P at P + bh * probs_stride + p_off. Heads in
// parallel (one launch on a kernel backend).
void attention_forward_range_heads(const float* qkv, int B, int H, int S, int hd, float scale, int first, int count,
                                   ProbsStore P, int64_t probs_stride, int64_t p_off, float* o);
// The same range of sample b, every head: its dq rows, and dk, dv of keys
// 0 .. first+count-1 in dqkv, continuing their folds when continue_kv
// (attention_backward_range).
void attention_backward_range_heads(const float* qkv, int b, int H, int S, int hd, float scale, int first, int count,
                                    ProbsView P, int64_t probs_stride, int64_t p_off, const float* dO, float* dqkv,
                                    bool continue_kv);
// The same backward in two parts, for a dK/dV chain pipelined over key
// blocks (model/context_parallel.cc), with attention_backward_range_heads'
// bits, for the heads [h0, h1): first dS (into dS, head h at (h - h0) *
// attention_range_probs_floats(count, first), P's layout) and the range's dq
// rows, which read no key's partial; then dk, dv of the keys [u0, u1) (u0 a
// multiple of 16), continuing the partial fold each key's row holds (+0
// where none). The engine's code only: a kernel backend runs
// attention_backward_range_heads.
void attention_backward_range_dq_heads(const float* qkv, int b, int H, int h0, int h1, int S, int hd, float scale,
                                       int first, int count, ProbsView P, int64_t probs_stride, int64_t p_off,
                                       const float* dO, float* dS, float* dqkv);
void attention_backward_range_dkv_heads(const float* qkv, int b, int H, int h0, int h1, int S, int hd, int first,
                                        int count, ProbsView P, int64_t probs_stride, int64_t p_off,
                                        const float* dS, const float* dO, float* dqkv, int u0, int u1);

}  // namespace ls::ops
