// The expert-parallel exchange plan of one layer (docs/MOE.md): which of a
// round's rows move from the sources' dispatch order into the owners'
// slots and back, packed in one order both sides walk alike. Without
// expert parallelism the same plan copies rows between the dispatch order
// and the slots directly. Made by the moe_dispatch block, used by the
// moe_experts block's rounds. Internal to src/model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "model/step_context.h"

namespace ls {

// An all-to-all in the expert-parallel group, counted in ctx.stats.
void ep_all_to_all(StepContext& ctx, const void* send, const std::vector<size_t>& send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes);

// Exchanges are collective: every EP rank runs the most rounds any owner needs.
int exchange_rounds(const LayerActs& acts);

// Round r's rows of `width` floats between the sources' dispatch order and
// the owners' slots. to_owner: source row `disp` is row src_index(disp) of
// src; the owner writes slot_buf (and, if keep, the row at its expert
// position in keep). Back: the owner reads slot_buf and the source writes
// disp_out[disp]. The rows move by ops::copy_rows over index lists built
// here (one kernel per list on the CUDA backend).
void exchange_rows(StepContext& ctx, const LayerActs& acts, int r, int width, bool to_owner, const float* src,
                   const std::function<int64_t(int64_t)>& src_index, float* slot_buf, float* keep, float* disp_out);

// The high-water marks of the MoE buffers, into ctx.stats (measured: the
// bytes allocated now).
void count_moe_memory(StepContext& ctx);

}  // namespace ls
