#include "model/step_sums.h"

#include "cluster/mesh.h"

namespace ls {

bool sum_over_step(StepContext& ctx, float* sums, size_t n, std::vector<float>& partial) {
  if (ctx.microbatches > 0) {
    partial.assign(sums, sums + n);
    return false;
  }
  ctx.mesh->stream_group().all_reduce_sum(sums, n);
  return true;
}

void sum_counts_over_step(StepContext& ctx, int64_t* counts, size_t n) {
  if (ctx.microbatches > 0) return;
  ctx.group(Axis::kData).all_reduce_sum(counts, n);
}

}  // namespace ls
