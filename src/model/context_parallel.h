// Context parallelism (mesh.cp): the attention block of every sample split
// across the ranks of a context-parallel group by position. Rank c holds
// some ranges of each sequence's positions (cp_query_ranges) and computes,
// for those positions only, the QKV projection, P and the attention output
// against every earlier key, the output projection and the input gradients
// of all three. K and V travel: each rank's rows are all-gathered after the
// projection. The routed experts are split too, by expert: every rank
// routes every token alike, then computes a block of the experts held
// (cp_expert_block: contiguous, cut to balance their rows) over all of
// their rows, and the group all-gathers the
// rows' outputs, input gradients and the experts' weight gradients. The
// shared expert goes as the projections do: its positions' rows here;
// its weight gradients by column. The residual stream's per-token ops (the
// embedding, norms, residual adds, router, combine, head) run on the rank's
// positions too (stream_rows), their rows gathered only for a fold over
// tokens: the routing plan, the losses' sums, the weight gradients.
//
// Two folds cross the split. dK and dV fold over query positions t >= u in
// ascending order (docs/NUMERICS.md §3): chained, as tensor parallel chains
// a split feature fold -- the range of the lowest positions folds from +0
// and hands each key's partial rows to the rank holding the next range,
// which continues them (ops::attention_backward_range), up to the last
// range, whose rank hands each rank the finished rows it reads. The projections' weight
// gradients fold over every token by the leaf tree: the rows are gathered
// and the gradient is split by output column instead (cp_weight_grad), so
// each column's fold is whole on one rank. The softmax and P·V of a query
// fold over its keys on one rank, as on one rank. So the bits are the same
// at every mesh.cp and either layout.
#pragma once

#include "ops/ops.h"

#include <functional>
#include <vector>

#include "model/step_context.h"
#include "ops/attention.h"
#include "model/rows.h"
#include "model/tensor_parallel.h"

namespace ls {

// ---- What the blocks call: each does the one-rank thing at cp 1. ----
// (The row helpers they use are model/rows.h.)

// The attention of a layer on this rank's rows: qkv [N, 3*Dh] = its rows of
// attn_in (the stream's rows held here, gathered through rows_held_of_stream)
// times wqkv (at cp > 1 every token's K and V gathered), P
// and attn_out [N, Dh] for its queries. Reduces over keys, one query's on one rank.
void attention_forward_held(StepContext& ctx, int layer, const float* attn_in, const float* wqkv, LayerActs& acts);
// dattn_out [N, Dh] of this rank's rows -> dqkv [N, 3*Dh] (cp_attention_backward at cp > 1).
void attention_backward_held(StepContext& ctx, const LayerActs& acts, const float* dattn_out, float* dqkv);
// Where a layer keeps P: as bf16 when numerics.precision=bf16 rounds it so and
// the CPU engine runs (half the bytes, the same values; ops::ProbsStore), else
// fp32. probs_store sizes it for `entries` and the forward writes it;
// probs_kept is the same store, read-only, for the backward.
bool probs_as_bf16();
ops::ProbsStore probs_store(LayerActs& acts, int64_t entries);
ops::ProbsView probs_kept(const LayerActs& acts);

// The experts' plan this rank computes: its EP rank's, or at cp > 1 its
// block of those experts (cp_own_experts, kept in `scratch`). Points the
// slots' d_ff-wide buffers at that plan's slots (ExpertSlots::hidden_base).
const RoundPlan& computed_expert_plan(const StepContext& ctx, const LayerActs& acts, RoundPlan& scratch);

// The stream's weight gradients, each a fold over the stream's tokens (its
// leaves): at cp > 1 over rows gathered first (gather_stream_rows_held), split by
// output column across the group (cp_weight_grad), so no rank folds another's
// columns. stream_weight_grad: dW [in, out] = X^T dY (ops::weight_grad, its
// operands at `operands`' precision). Reduces over the token index.
void stream_weight_grad(StepContext& ctx, const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                        float* dW, ops::Operands operands = ops::Operands::kRun);
// The norm's dw (ops::rmsnorm_weight_grad) of x, r, dy [stream_tokens, D]. Reduces over the token index.
void stream_rmsnorm_weight_grad(StepContext& ctx, const float* x, const float* r, const float* dy, float* dw);
// The embeddings' gradients (ops::embedding_grad) of the stream's dh. Reduces over the token index.
void stream_embedding_grad(StepContext& ctx, const int* tok, const float* dh, float* gtok, float* gpos);

// ---- The pieces. ----

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
// Keys per message of the dK/dV chain on the engine (cp_attention_backward
// pipelines each link over key blocks): about an eighth of a rank's share of
// the sequence, a multiple of 16 (the probabilities' layout).
int cp_chain_key_block(int S, int cp);

// Floats of P one (sample, head) keeps on CP rank `rank`.
int64_t cp_probs_floats(int S, int cp, int rank, bool zigzag);

// This rank's rows of samples [first_sample, first_sample + samples): fn(row,
// count) for each of its ranges of each sample, row = b * seq_len + first.
void cp_for_each_held(const StepContext& ctx, int first_sample, int samples,
                      const std::function<void(int64_t row, int count)>& fn);


// Columns [col, col + width) of an [N, ld] token-row matrix, samples
// [first_sample, first_sample + samples): every rank's held rows made whole
// on every rank (an all-gather); m's first row is token m_first_row. `kv`: the bytes count as K/V traffic.
// `while_in_flight`: work to do while the all-gather is in flight (it is
// then started, and waited for after), given a call that progresses it.
using InFlightWork = std::function<void(const std::function<void()>& progress)>;
void cp_gather_rows(StepContext& ctx, float* m, int64_t ld, int col, int width, int first_sample, int samples,
                    bool kv = false, const InFlightWork& while_in_flight = nullptr, int64_t m_first_row = 0);

// CP rank `rank`'s items [first, first + count) of n consecutive ones
// (a weight gradient's output columns, the experts held): ceil(n / cp)
// each, the last ranks fewer, or none.
struct CpShare {
  int first = 0, count = 0;
};
CpShare cp_share(int n, int cp, int rank);

// dW [in, out] = the weight gradient of every token's rows X [N, ldx] and
// dY [N, ldy] (ops::weight_grad, the step's leaf tree), computed a share of
// the output columns per rank and all-gathered: each column's fold is the
// whole one. Reduces over the global token index, on one rank per column.
void cp_weight_grad(StepContext& ctx, const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                    float* dW);
// Columns [0, cols) of the matrices `outs` ({data, rows} each, [rows, cols]
// row-major), a cp_share of them computed per rank: fn(first, count, parts)
// writes [rows, count] of each, packed, to parts[i]; then all-gathered into
// place on every rank.
struct ColumnsOut {
  float* data;
  int64_t rows;
};
void cp_columns(StepContext& ctx, int cols, const std::vector<ColumnsOut>& outs,
                const std::function<void(int first, int count, const std::vector<float*>& parts)>& fn);
// ops::weight_grad over every token (the leaf tree), or cp_weight_grad at cp > 1.
void token_weight_grad(StepContext& ctx, const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                       float* dW);

// Adds its lifetime to ctx.stats.cp_attention_seconds: a rank's share of
// the attention block's compute, not its waits (kernels synchronized).
class CpBusy {
 public:
  explicit CpBusy(StepContext& ctx);
  ~CpBusy();

 private:
  StepContext& ctx_;
  double t0_;
};

// The experts CP rank `rank` computes of EP owner `owner`'s (its local
// experts at ep 1): a contiguous block, cut where the blocks' rows (that
// owner's plan's loads) come nearest equal, so no rank holds most of the
// rows' buffers. Every rank derives the same cut from the same plans. With
// a pipeline's expert parallel (grads_by_source: an expert's gradient
// accumulates over microbatches on one rank) the fixed cp_share of the
// experts instead.
CpShare cp_expert_block(const StepContext& ctx, const LayerActs& acts, int owner, int rank);
// `plan` with only this rank's block's segments: the rounds, slots and
// capacity as they were, so each row is computed where and when it would
// be (rows are independent; an expert's gradient folds whole here).
RoundPlan cp_own_experts(const StepContext& ctx, const LayerActs& acts, const RoundPlan& plan);

// Dispatch rows [NK, width] (acts.expert_off's order): each rank's experts'
// rows made whole on every rank (an all-gather; nothing at cp 1). Reduces over nothing.
void gather_expert_rows(StepContext& ctx, const LayerActs& acts, float* rows, int width);

// A weight gradient [local_experts, per_expert]: each rank's block's slabs
// made whole on every rank (an all-gather; nothing at cp 1). Reduces over nothing.
void gather_expert_grads(StepContext& ctx, const LayerActs& acts, float* grad, int64_t per_expert);

// qkv [N, 3*Dh]: this rank's rows' q, every token's k and v. Forward: P gets
// this rank's ranges of every (sample, head), attn_out [N, Dh] their rows.
void cp_attention_forward(StepContext& ctx, const float* qkv, int heads, int hd, float scale, ops::ProbsStore P,
                          float* attn_out);

// Backward: dattn_out [N, Dh] of this rank's rows -> dqkv [N, 3*Dh]: dq
// computed by the rank holding each query and all-gathered; dk, dv folded
// along cp_chain, the last link's rank handing each rank its own rows and
// every row's columns of its wqkv gradient share (cp_share of 3*Dh).
// Those, and dq, are what a rank reads; its other dk, dv entries are stale.
void cp_attention_backward(StepContext& ctx, const float* qkv, int heads, int hd, float scale, ops::ProbsView P,
                           const float* dattn_out, float* dqkv);

}  // namespace ls
