// Tensor parallelism's one hard part: a fold over a feature index whose
// range is split between the ranks of the tensor-parallel group (a
// row-parallel GEMM such as the output projection or w2, or the input
// gradient of a column-parallel one such as QKV or w1/w3). The contract
// folds k sequentially from +0 (docs/NUMERICS.md §3); an all-reduce of
// partial folds would change the bits, so the fold is chained instead: the
// rank holding the first k-range folds first and hands its partial outputs
// to the rank holding the next range, which continues every output's fold
// (ops::gemm with accumulate), and so on; the last one broadcasts the
// finished outputs. Each link carries one output tensor.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/rows.h"
#include "model/step_context.h"

namespace ls {

// Where a chained fold's outputs live. A contiguous output is handed over
// as is (pack/unpack empty); scattered rows (expert slots) are packed into
// `floats` contiguous floats and unpacked on the receiving rank, in `parts`
// parts: part b is floats [part_offset[b], part_offset[b + 1]) of the
// buffer, and the chain is pipelined over the parts as over row blocks.
struct ChainOutput {
  float* data = nullptr;  // contiguous outputs (or nullptr when packed)
  int64_t floats = 0;
  int parts = 1;
  std::vector<int64_t> part_offset;  // parts + 1 offsets (empty: one part, all floats)
  std::function<void(int part, float*)> pack;          // outputs -> buffer
  std::function<void(int part, const float*)> unpack;  // buffer -> outputs
  // Sequence parallel: the finished outputs (contiguous, token rows) land
  // scattered instead of broadcast -- TP rank t gets only its stream tokens'
  // rows, in place -- the chained equivalent of a reduce-scatter.
  bool scatter = false;
  // > 0: the outputs are `rows` contiguous rows (data, floats = rows x
  // width), and the chain is pipelined over blocks of them: rank t
  // continues block b while rank t - 1 folds block b + 1 (each output's
  // fold is over k alone, so cutting the rows changes no bit). 0: one
  // block, or the packed outputs' parts.
  int64_t rows = 0;
  // A fold over a routed expert's hidden features: chained over the group
  // that splits them (StepContext::expert_tensor_axis: mesh.etp's ranks),
  // not the tensor group.
  bool expert_hidden = false;

  // Floats [part_begin(b), part_begin(b + 1)) of the packed buffer are part b.
  int64_t part_begin(int b) const { return part_offset.empty() ? (b == 0 ? 0 : floats) : part_offset[(size_t)b]; }
};

// How many row blocks a pipelined chain cuts `rows` into: blocks of at
// least 64 rows (the GEMMs stay efficient; a 16-row microkernel sees 4 or
// more tiles), at most 8 (the pipeline's fill, tp - 1 blocks, stays small
// beside 8 x passes blocks of work), so 1 for fewer than 128 rows.
int chain_blocks(int64_t rows);

// The fold's k-range, in the contract's order, is `passes` x tp segments,
// pass-major: segment p * tp + t belongs to TP rank t (passes > 1 where one
// fold crosses several split blocks, e.g. the q, k and v columns of QKV,
// or the hidden features of u and then of v). fold(first_pass, count,
// accumulate) continues (accumulate) or starts (+0) every output's fold over
// this rank's segments of passes first_pass .. first_pass + count - 1, for
// the outputs of `block` (every row and part, unless out.rows or out.parts
// pipeline the chain); on one rank all passes and rows come in one call. On return every
// rank of the group holds the finished outputs. Reduces over the split
// feature index, in ascending order, whatever the group size.
using ChainStep = std::function<void(int first_pass, int count, bool accumulate, RowBlock block)>;
void chained_fold(StepContext& ctx, int passes, const ChainOutput& out, const ChainStep& fold);

// The head's rows. With tensor parallel alone (no sequence or context
// parallel, no pipeline's microbatches) every TP rank holds the whole
// stream and the head would be replicated work, so each runs it on its
// share of the tokens, whole leaves, as sequence parallel would: a view of
// ctx whose stream is those tokens (a power-of-two number of leaves each,
// an aligned subtree of this rank's leaves). Anywhere else: ctx itself.
StepContext head_rows(const StepContext& ctx);
// Folds over the head's rows (sums[0, n): the loss's sum, its weight
// gradients) made the fold over the stream's: where head_rows split the
// tokens, summed over the TP group by the canonical tree over its aligned
// subtrees; else nothing. Reduces over the token index.
void join_head_sums(StepContext& ctx, const StepContext& head, float* sums, size_t n);
// dh [stream_tokens, width], of which the head wrote its own rows: every
// TP rank's rows made whole on each (an all-gather) where head_rows split.
void join_head_rows(StepContext& ctx, const StepContext& head, float* dh, int64_t width);

// Sequence parallel: each TP rank wrote the expert-output gradients (ws.dye,
// dispatch order) of its stream tokens' rows; the experts need every row's.
// The rows of every token, in (token, slot) order, gathered over the group
// and put back at their dispatch rows. Under a mesh.etp wider than mesh.tp
// the token group's rows are gathered too (the experts' batch,
// expert_parallel.h). Nothing on one rank's tokens without sequence parallel.
void gather_expert_output_grads(StepContext& ctx, const LayerActs& acts);

// A chained fold's [N, D] output over every token: broadcast, or with
// sequence parallel scattered to each rank's stream rows.
ChainOutput stream_output(StepContext& ctx, float* data);

}  // namespace ls
