// The rows of a data-parallel rank's tokens that the blocks read and write,
// in one vocabulary. Three sets of rows (a row is a token's index in the
// step's N tokens):
//   every token   all N rows;
//   stream rows   [stream_first, stream_first + stream_tokens): the rows of
//                 the residual stream kept here (sequence parallel: this
//                 tensor-parallel rank's share; else every token);
//   rows held     the positions this rank computes (context parallel: its
//                 ranges of every sample; else every token).
// And three kinds of call, named after the set they act on:
//   rows_held(...), stream_rows(...)      fn(row, count) over the set;
//   gather_<set>(...)                     a buffer whose rows of the set each
//                                         rank wrote, made whole on every rank
//                                         of the group (an all-gather; nothing
//                                         where the set is every token);
//   every_token(...), stream_rows_out()   the whole a GEMM reads, or where a
//                                         per-token op writes its set's rows.
// Each does the one-rank thing on one rank, so a block calls them without
// asking the mesh. Context parallel's are in context_parallel*.cc, sequence
// parallel's in tensor_parallel.cc.
#pragma once

#include <cstdint>
#include <functional>

#include "model/step_context.h"

namespace ls {

// The block of outputs one link of a pipelined chain folds: output rows
// [first, first + count) of contiguous outputs, or part `part` of packed
// ones (part -1: every part, when the chain runs in one call).
struct RowBlock {
  int64_t first = 0, count = 0;
  int part = -1;
};

// ---- Rows held (context parallel). ----

// fn(row, count) over the rows this rank computes: every token in one call
// at cp 1, else its positions' ranges of every sample (their compute
// counted as the rank's busy time).
void rows_held(StepContext& ctx, const std::function<void(int64_t row, int count)>& fn);
// The same inside the rows of `block` (a pipelined chain's link).
void rows_held(StepContext& ctx, RowBlock block, const std::function<void(int64_t row, int count)>& fn);

// rows_held (busy: counted as rows_held counts) or rows_held_untimed over a
// stream tensor [stream_tokens, D] that a column-parallel GEMM reads for
// every token: fn(x, row, count), x pointing at row `row`'s data. It starts
// on the rows at hand (every_token_rows: sequence parallel's own rows while
// the others arrive); at cp > 1 after the gather, on this rank's positions.
// Returns every token's rows (every_token).
using RowsHeldOf = std::function<void(const float* x, int64_t row, int count)>;
const float* rows_held_of_stream(StepContext& ctx, const float* stream, ops::DeviceVector<float>& gathered,
                                 bool busy, const RowsHeldOf& fn);

// An [N, ld] matrix whose rows each rank wrote for its positions made
// whole on every rank (an all-gather; nothing at cp 1).
void gather_rows_held(StepContext& ctx, float* m, int64_t ld);

// rows_held with its time not counted as the rank's busy time (a caller
// whose own timer counts it): fn(0, N) for every token at cp 1, else
// cp_for_each_held over every sample.
void rows_held_untimed(const StepContext& ctx, const std::function<void(int64_t row, int count)>& fn);
// The same inside the rows of `block`.
void rows_held_untimed(const StepContext& ctx, RowBlock block, const std::function<void(int64_t row, int count)>& fn);

// ---- Stream rows. ----

// fn(row, count) over the stream's rows this rank computes, `row` a token's
// index in the step (a stream buffer holds it at row - stream_first): all of
// [stream_first, stream_first + stream_tokens) in one call at cp 1, else this
// rank's positions of those samples. Adds the rows to stats.stream_rows[op].
void stream_rows(StepContext& ctx, StreamOp op, const std::function<void(int64_t row, int count)>& fn);

// A stream buffer [stream_tokens, ld] (its row 0 the token stream_first)
// whose rows each CP rank wrote for its positions, made whole on every rank
// of the group where a fold over tokens reads them (an all-gather; nothing
// at cp 1). Ints travel as their bytes.
void gather_stream_rows_held(StepContext& ctx, float* m, int64_t ld);
void gather_stream_rows_held(StepContext& ctx, int* m, int64_t ld);

// Expert rows [N * top_k, width] (acts.row_of's rows) that each CP rank
// wrote for its positions' slots, made whole on every rank (nothing at cp 1).
void gather_slot_rows_held(StepContext& ctx, const LayerActs& acts, float* rows, int64_t width);

// ---- Every token (sequence parallel). ----

// Sequence parallel: full[N, width] = every TP rank's stream rows
// local[stream_tokens, width], in token order (an all-gather). Without
// sequence parallel local is already the whole and is copied.
void gather_stream_rows(StepContext& ctx, const float* local, float* full, int64_t width);

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

}  // namespace ls
