// The moe_experts block: the routed experts' SwiGLU over their rows, in the
// rounds and slots of the layer's plan, each round's rows exchanged to
// their owners and back. Matches ref::MoeExperts (per row: independent;
// weight gradients: each expert's leaf tree over its rows). Context
// parallel: each rank of the group computes a block of the experts over
// all their rows, and the group gathers the results (context_parallel.h).
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "model/blocks.h"
#include "model/context_parallel.h"
#include "model/expert_parallel.h"
#include "model/tensor_parallel.h"
#include "ops/ops.h"

namespace ls {

namespace {

class MoeExperts : public LayerBlock {
 public:
  explicit MoeExperts(int layer) : LayerBlock(layer, "moe_experts") {}

  // moe_in rows -> ye (dispatch order).
  void forward(StepContext& mine, StepLosses&) override {
    std::optional<StepContext> view;
    StepContext& ctx = expert_batch(mine, view);  // the experts' batch (these tokens, or their token group's)
    const int D = ctx.cfg.d_model, F = ctx.expert_d_ff_held();
    StepWorkspace& ws = ctx.ws;
    LayerActs& acts = ctx.layer(layer_);
    ExpertRows& rows = acts.rows;
    RoundPlan cp_plan;
    const RoundPlan& own = computed_expert_plan(ctx, acts, cp_plan);
    const ExpertWeights w = weights(ctx);
    // The outputs land in the slots and travel back, or straight in the dispatch rows the combine reads.
    const RowPlace y = round_output_place(ctx, ws.slots.y.data(), acts.ye.data());
    const int rounds = exchange_rounds(acts);
    // The last round's rows go back while the combine computes the shared expert (it finishes the exchange).
    const bool hide_last = exchange_overlaps_shared_expert(ctx, acts);
    for (int r = 0; r < rounds; ++r) {
      send_round_inputs(ctx, acts, r);
      if (r < own.rounds()) {
        ctx.stats.expert_gemm_calls += experts_round_hidden(own, r, ws.slots, rows, w.w1, w.w3, D, F);
        // y reduces over the hidden feature (tensor parallel: chained across the group's ranges of it,
        // pipelined over pieces of the round's rows).
        const std::vector<std::vector<Segment>> pieces = chain_pieces(own.round[r]);
        chained_fold(ctx, 1, round_chain(own.round[r], pieces, rows, y, D), [&](int, int, bool accumulate, RowBlock b) {
          ctx.stats.expert_gemm_calls +=
              experts_round_output(segments_of(own.round[r], pieces, b), ws.slots, rows, y, w.w2, D, F, accumulate);
        });
      }
      if (hide_last && r == rounds - 1) start_return_round_rows(ctx, acts, r, ws.slots.y.data(), acts.ye.data());
      else return_round_rows(ctx, acts, r, ws.slots.y.data(), acts.ye.data());
    }
    gather_expert_rows(ctx, acts, acts.ye.data(), D);  // context parallel: every block's rows, here
    const RoundPlan& planned = ctx.own_plan(acts);
    ctx.stats.rounds = std::max(ctx.stats.rounds, planned.rounds());
    ctx.stats.borrowed += planned.borrowed;
    ctx.stats.dropped += planned.dropped;
    acts.ye_rows = acts.ye.data();
    if (!hide_last) return trace_outputs(mine);
    // The outputs are whole once the combine finished the exchange (in this range of blocks, on this ctx).
    ws.exchange_in_flight.unpack = [unpack = std::move(ws.exchange_in_flight.unpack), this, &mine] {
      unpack();
      trace_outputs(mine);
    };
  }

  // dye (dispatch order) -> dxe; the experts' weight gradients. Backward in
  // the forward's rounds and slots; the weight-gradient leaf trees continue
  // from round to round.
  void backward(StepContext& mine) override {
    std::optional<StepContext> view;
    StepContext& ctx = expert_batch(mine, view);
    const int D = ctx.cfg.d_model, F = ctx.expert_d_ff_held();
    const int64_t NK = ctx.tokens * ctx.cfg.top_k;
    StepWorkspace& ws = ctx.ws;
    LayerActs& acts = ctx.layer(layer_);
    ExpertRows& rows = acts.rows;
    RoundPlan cp_plan;
    const RoundPlan& own = computed_expert_plan(ctx, acts, cp_plan);
    const ExpertWeights w = weights(ctx);
    ws.dxe.resize(NK * D);
    if (ctx.cfg.moe_policy == MoePolicy::kDrop) ops::fill(ws.dxe.data(), NK * D, 0.0f);  // skipped rows: no gradient
    begin_expert_grads(ctx, layer_, own, rows);
    count_moe_memory(ctx);
    // dy and dx in the slots (travelling to and from the owners), or in the dispatch rows (the experts' row order).
    const RowPlace dy = round_output_place(ctx, ws.slots.dy.data(), ws.dye.data());
    const RowPlace dx = round_output_place(ctx, ws.slots.dx.data(), ws.dxe.data());
    for (int r = 0; r < exchange_rounds(acts); ++r) {
      // Round 0's may have been started by the combine, hidden behind the shared expert's backward.
      if (r > 0 || !finish_round_exchange(ctx)) send_round_output_grads(ctx, acts, r);
      if (r < own.rounds()) {
        refill_round_inputs(ctx, acts, own, r);  // the inputs again, into the same slots
        ctx.stats.expert_gemm_calls += experts_round_backward_hidden(own, r, ws.slots, rows, dy, w.w2, D, F);
        // dx reduces over the hidden feature of u, then of v (tensor parallel: chained).
        const std::vector<std::vector<Segment>> pieces = chain_pieces(own.round[r]);
        chained_fold(ctx, 2, round_chain(own.round[r], pieces, rows, dx, D),
                     [&](int first, int count, bool accumulate, RowBlock b) {
          ctx.stats.expert_gemm_calls += experts_round_input_grad(segments_of(own.round[r], pieces, b), ws.slots, rows,
                                                                  dx, w.w1, w.w3, D, F, first, count, accumulate);
        });
        add_expert_grads(ctx, layer_, own, r, rows, dy);
      }
      return_round_rows(ctx, acts, r, ws.slots.dx.data(), ws.dxe.data());
    }
    gather_expert_rows(ctx, acts, ws.dxe.data(), D);
    finish_expert_grads(ctx, layer_, acts);
    if (mine.trace)  // this rank's tokens' rows
      mine.trace_tensor("bwd", layer_, "moe.experts", "dx", mine.token_slot_order(acts, ws.dxe.data(), D),
                        {mine.tokens, mine.cfg.top_k, D});
  }


 private:
  // The experts' outputs, every row in place.
  void trace_outputs(StepContext& ctx) const {
    if (!ctx.trace) return;
    const int D = ctx.cfg.d_model;
    const LayerActs& acts = ctx.layer(layer_);
    ctx.trace_tensor("fwd", layer_, "moe.experts", "out", ctx.token_slot_order(acts, acts.ye_rows, D),
                     {ctx.tokens, ctx.cfg.top_k, D});
  }
  // A round's segments cut for a tensor-parallel chain: pieces of near-equal
  // rows (chain_blocks, as for token rows), one piece on one rank; on one
  // rank the fold is whole and the pieces go unused.
  static std::vector<std::vector<Segment>> chain_pieces(const std::vector<Segment>& segs) {
    return cut_segments(segs, chain_blocks(segment_rows(segs)));
  }
  // The segments a chain link folds: its piece, or the whole round.
  static const std::vector<Segment>& segments_of(const std::vector<Segment>& round,
                                                 const std::vector<std::vector<Segment>>& pieces, RowBlock b) {
    return b.part < 0 ? round : pieces[(size_t)b.part];
  }
  // A round's rows at `place` as a chained fold's output: packed piece by piece, in segment order.
  static ChainOutput round_chain(const std::vector<Segment>& round, const std::vector<std::vector<Segment>>& pieces,
                                 const ExpertRows& rows, RowPlace place, int D) {
    ChainOutput out;
    out.expert_hidden = true;
    out.floats = segment_rows(round) * D;
    out.parts = (int)pieces.size();
    out.part_offset.push_back(0);
    for (const auto& piece : pieces) out.part_offset.push_back(out.part_offset.back() + segment_rows(piece) * D);
    out.pack = [&pieces, &rows, place, D](int b, float* at) { pack_rows(pieces[(size_t)b], rows, place, D, at); };
    out.unpack = [&pieces, &rows, place, D](int b, const float* at) { unpack_rows(pieces[(size_t)b], rows, place, D, at); };
    return out;
  }
  struct ExpertWeights {
    const float *w1, *w3, *w2;  // [experts held, D, F], [.., D, F], [.., F, D]
  };
  ExpertWeights weights(const StepContext& ctx) const {
    return {ctx.layer_weight(layer_, "experts.w1"), ctx.layer_weight(layer_, "experts.w3"),
            ctx.layer_weight(layer_, "experts.w2")};
  }
};

}  // namespace

std::unique_ptr<Block> make_moe_experts_block(int layer) { return std::make_unique<MoeExperts>(layer); }

}  // namespace ls
