// Expert parallelism (mesh.ep): the exchange plan of one layer
// (docs/MOE.md). The EP group shares every rank's counts per expert and
// each row's leaf id; each round's rows move from the sources' dispatch
// order into the owners' slots and back, packed in one order both sides
// walk alike. Every call here does the one-rank thing at ep 1 (rows copied
// between the dispatch order and the slots directly, or nothing), so the
// moe_dispatch and moe_experts blocks have no expert-parallel branch.
// Internal to src/model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "model/step_context.h"

namespace ls {

// ---- What the blocks call. ----

// The tokens the routed experts take as one batch: this data-parallel
// rank's, or under a mesh.etp wider than mesh.tp those of its token group
// (Axis::kExpertTokens), this rank's from `first = its place x N`.
// gather_expert_batch (the dispatch's forward) all-gathers the group's
// selections and inputs (acts.batch_sel, acts.batch_in); expert_batch is
// ctx itself on one data rank's tokens, else a view of it over the batch
// (tokens, leaves, samples) kept in `view`. own_rows_of puts this rank's
// tokens' rows (acts.row_of) out of the batch's (`all`, which is acts.row_of
// itself on one data rank's tokens).
void gather_expert_batch(StepContext& ctx, LayerActs& acts);
StepContext& expert_batch(StepContext& ctx, std::optional<StepContext>& view);
ops::DeviceVector<int64_t>& batch_rows_of(const StepContext& ctx, LayerActs& acts);
void own_rows_of(const StepContext& ctx, LayerActs& acts);

// acts.counts[src * E + e] = rows of EP rank src for expert e (at ep 1: the
// loads), from every rank's acts.expert_off.
void exchange_expert_counts(StepContext& ctx, LayerActs& acts);
// acts.rows.leaf: the leaf of every row of the experts held here, from the
// source ranks (at ep 1: this rank's rows' own leaves). After the plans.
void exchange_leaf_ids(StepContext& ctx, LayerActs& acts);
// The buffers a layer's rounds need, grown to its plans and counted.
void hold_moe_buffers(StepContext& ctx, LayerActs& acts);

// Forward, round r: the rows' inputs (moe_in of their tokens) into the
// owners' slots (ws.slots.x); at ep > 1 each arriving row is also kept at
// its expert position (acts.rows.x) for the backward.
void send_round_inputs(StepContext& ctx, LayerActs& acts, int r);
// Where a round writes its outputs (dispatch_rows: the [NK, D] rows in
// dispatch order): the slots, sent back by return_round_rows at ep > 1, or
// straight into the dispatch rows at ep 1.
RowPlace round_output_place(const StepContext& ctx, float* slots, float* dispatch_rows);
// Round r's outputs from the owners' slots back into the sources'
// dispatch rows (nothing at ep 1: they were written there).
void return_round_rows(StepContext& ctx, const LayerActs& acts, int r, const float* slots, float* dispatch_rows);
// Backward, round r: the output gradients (ws.dye, dispatch order) into the
// owners' slots (ws.slots.dy; nothing at ep 1, where they are read in place).
void send_round_output_grads(StepContext& ctx, const LayerActs& acts, int r);
// The exchanges the shared expert's compute can hide (mesh.overlap, ep > 1,
// a shared expert, cp 1): the forward's last round back to the sources,
// started by the experts and finished by the combine after the shared
// expert's forward; the backward's first round of output gradients to the
// owners, started by the combine before the shared expert's backward and
// finished by the experts. Rows are only moved, so the bits are the same.
bool exchange_overlaps_shared_expert(const StepContext& ctx, const LayerActs& acts);
// return_round_rows and send_round_output_grads, started: the all-to-all in
// flight, its unpack left in ws.exchange_in_flight.
void start_return_round_rows(StepContext& ctx, const LayerActs& acts, int r, const float* slots, float* dispatch_rows);
void start_round_output_grads(StepContext& ctx, const LayerActs& acts, int r);
// Lets a started exchange's all-to-all move while the rank computes (MPI
// progresses it only inside its calls); nothing if none is in flight.
void progress_round_exchange(StepContext& ctx);
// Waits for the started exchange and unpacks its rows; false if none was started.
bool finish_round_exchange(StepContext& ctx);
// Backward, round r of `plan`: the rows' inputs into the slots again, from
// the rows kept at ep > 1, else from the tokens' moe_in.
void refill_round_inputs(StepContext& ctx, const LayerActs& acts, const RoundPlan& plan, int r);

// The routed experts' weight gradients of a layer, folded round by round
// into their leaf trees (ExpertWeightGrads, over the leaves of every source
// rank). Where a pipeline's microbatches each bring an expert's rows from
// every EP rank, they are kept per source across the step instead
// (ExpertGradsBySource) and finished at its last microbatch. Reduces over
// the token index.
void begin_expert_grads(StepContext& ctx, int layer, const RoundPlan& own, const ExpertRows& rows);
void add_expert_grads(StepContext& ctx, int layer, const RoundPlan& own, int r, const ExpertRows& rows, RowPlace dy);
// After the last round: the step's gradients into the layer's experts.w1,
// w3, w2 (at cp > 1 each rank's experts gathered) if this pass finishes them.
void finish_expert_grads(StepContext& ctx, int layer, const LayerActs& acts);

// Owner rank d's round plan for every d (acts.plans), from the exchanged
// counts, and the rows of the experts held here (acts.rows.off).
void plan_owner_rounds(StepContext& ctx, LayerActs& acts);

// ---- The pieces. ----

// An all-to-all in the expert-parallel group, counted in ctx.stats: done
// on return, or with `started` set started (*started to wait for).
void ep_all_to_all(StepContext& ctx, const void* send, const std::vector<size_t>& send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes, Pending* started = nullptr);

// Exchanges are collective: every EP rank runs the most rounds any owner needs.
int exchange_rounds(const LayerActs& acts);

// Round r's rows of `width` floats between the sources' dispatch order and
// the owners' slots. to_owner: source row `disp` is row src_index(disp) of
// src; the owner writes slot_buf (and, if keep, the row at its expert
// position in keep). Back: the owner reads slot_buf and the source writes
// disp_out[disp]. The rows move by ops::copy_rows over index lists built
// here (one kernel per list on the CUDA backend).
// start: at ep > 1 the all-to-all is started and the unpack left in
// ws.exchange_in_flight (finish_round_exchange).
void exchange_rows(StepContext& ctx, const LayerActs& acts, int r, int width, bool to_owner, const float* src,
                   const std::function<int64_t(int64_t)>& src_index, float* slot_buf, float* keep, float* disp_out,
                   bool start = false);

// The high-water marks of the MoE buffers, into ctx.stats (measured: the
// bytes allocated now).
void count_moe_memory(StepContext& ctx);

}  // namespace ls
