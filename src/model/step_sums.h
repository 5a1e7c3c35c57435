// The step's token sums (losses, router statistics, expert counts): each
// block folds the tokens it holds into its leaf subtrees; these make the
// step's totals from them, by the contract's tree over ranks. Where they go
// is the mesh's business, not the block's: the stream's ranks (data, and
// tensor under sequence parallel), or a pipeline's fold over microbatches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/step_context.h"

namespace ls {

// sums[0, n): this rank's subtrees of a fold over the stream's tokens, made
// the step's (summed over the stream group). In one microbatch of a
// pipeline they are copied to `partial` instead, for the pipeline's tree
// over microbatches (runner/pipeline.cc), and false is returned: the step's
// sums are not known yet. Reduces over the data (and sequence) index.
bool sum_over_step(StepContext& ctx, float* sums, size_t n, std::vector<float>& partial);

// Per-expert assignment counts [n] of this data-parallel rank made every
// data-parallel rank's (integers: the order is free). Nothing to do in a
// pipeline's microbatch (the pipeline sums them over microbatches first).
void sum_counts_over_step(StepContext& ctx, int64_t* counts, size_t n);

}  // namespace ls
