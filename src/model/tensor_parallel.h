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

#include "model/step_context.h"

namespace ls {

// The block of outputs one link of a pipelined chain folds: output rows
// [first, first + count) of contiguous outputs, or part `part` of packed
// ones (part -1: every part, when the chain runs in one call).
struct RowBlock {
  int64_t first = 0, count = 0;
  int part = -1;
};

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

// Sequence parallel: full[N, width] = every TP rank's stream rows
// local[stream_tokens, width], in token order (an all-gather). Without
// sequence parallel local is already the whole and is copied.
void gather_stream(StepContext& ctx, const float* local, float* full, int64_t width);

// Tensor parallel: rows [t x rows, (t + 1) x rows) of full[tp x rows,
// width] are TP rank t's; afterwards every rank holds them all (an
// all-gather in place, through the shared slot where there is one).
void gather_tp_rows(StepContext& ctx, float* full, int64_t rows, int64_t width);

// A stream tensor [stream_tokens, D] as every token's [N, D] (what a
// column-parallel GEMM reads, or the stream's gradient a row-parallel one
// needs): `held` itself, or with sequence parallel the TP group's rows
// gathered into `gathered`.
const float* every_token(StepContext& ctx, const float* held, ops::DeviceVector<float>& gathered);

// every_token for a column-parallel GEMM that starts on the rows at hand:
// at_hand(rows, first, count) is called on every token's rows [first, first
// + count) in pieces -- with sequence parallel this rank's own stream rows
// at once, then each other rank's as it arrives (shared memory) or once the
// gather is done; without, every token in one call. Rows are independent,
// so the order changes no bit. Returns what every_token returns.
using RowsAtHand = std::function<void(const float* rows, int64_t first, int64_t count)>;
const float* every_token_rows(StepContext& ctx, const float* held, ops::DeviceVector<float>& gathered,
                              const RowsAtHand& at_hand);

// Sequence parallel: each TP rank wrote the expert-output gradients (ws.dye,
// dispatch order) of its stream tokens' rows; the experts need every row's.
// The rows of every token, in (token, slot) order, gathered over the group
// and put back at their dispatch rows. Nothing without sequence parallel.
void gather_expert_output_grads(StepContext& ctx, const LayerActs& acts);

// Sequence parallel: where a per-token op on this rank's stream tokens
// writes rows that every token's reader needs (`held`, sized here), and the
// gather that completes `whole` from them. Without sequence parallel the op
// writes `whole` itself and the gather does nothing.
template <class T>
T* stream_rows_out(const StepContext& ctx, ops::DeviceVector<T>& whole, ops::DeviceVector<T>& held, int64_t width) {
  held.resize(ctx.sp ? ctx.stream_tokens * width : 0);
  return ctx.sp ? held.data() : whole.data();
}
void gather_stream_rows(StepContext& ctx, const ops::DeviceVector<float>& held, ops::DeviceVector<float>& whole,
                        int64_t width);
void gather_stream_rows(StepContext& ctx, const ops::DeviceVector<int>& held, ops::DeviceVector<int>& whole,
                        int64_t width);

// A chained fold's [N, D] output over every token: broadcast, or with
// sequence parallel scattered to each rank's stream rows.
ChainOutput stream_output(StepContext& ctx, float* data);

}  // namespace ls
