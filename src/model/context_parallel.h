// Context parallelism (mesh.cp): the attention of every sample split across
// the ranks of a context-parallel group by query position. Rank c holds
// some ranges of each sequence's positions (cp_query_ranges) and computes
// their rows of P and of the attention output against every earlier key;
// the layer around attention (norms, projections, experts, head) runs on
// every rank of the group alike, so each holds every token's K and V.
//
// The one fold the split cuts is dK and dV's, over query positions t >= u
// in ascending order (docs/NUMERICS.md §3). It is chained, as tensor
// parallel chains a split feature fold: the range of the lowest positions
// folds from +0 and hands each key's partial rows to the rank holding the
// next range, which continues them (ops::attention_backward_range), up to
// the last range, whose rank broadcasts the finished rows. The softmax and
// P·V of a query fold over its keys on one rank, as on one rank. So the
// bits are the same at every mesh.cp and either layout.
#pragma once

#include <vector>

#include "model/step_context.h"

namespace ls {

// Query positions [first, first + count) of a sequence.
struct QueryRange {
  int first = 0, count = 0;
};

// The ranges CP rank `rank` of `cp` holds of an S-position sequence, in
// ascending order. zigzag: S cut into 2*cp chunks, rank c holding chunks c
// and 2*cp - 1 - c, so every rank gets the same causal work; contiguous:
// chunk c of cp (the last rank does the most). S must divide evenly.
std::vector<QueryRange> cp_query_ranges(int S, int cp, int rank, bool zigzag);

// Every range of the sequence in ascending position with its rank: the
// order dK and dV pass through.
struct ChainLink {
  QueryRange range;
  int rank = 0;
};
std::vector<ChainLink> cp_chain(int S, int cp, bool zigzag);

// Floats of P one (sample, head) keeps on CP rank `rank`.
int64_t cp_probs_floats(int S, int cp, int rank, bool zigzag);

// qkv [N, 3*Dh] holds every token's (each rank of the group computed it).
// Forward: P gets this rank's ranges of every (sample, head), attn_out
// [N, Dh] every token's rows (its own computed, the others' all-gathered).
void cp_attention_forward(StepContext& ctx, const float* qkv, int heads, int hd, float scale, float* P,
                          float* attn_out);

// Backward: dattn_out [N, Dh] of every token -> dqkv [N, 3*Dh] of every
// token: dq computed by the rank holding each query and all-gathered; dk, dv
// folded along cp_chain and broadcast by the last link's rank.
void cp_attention_backward(StepContext& ctx, const float* qkv, int heads, int hd, float scale, const float* P,
                           const float* dattn_out, float* dqkv);

}  // namespace ls
