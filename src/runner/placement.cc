#include "runner/placement.h"

#include <algorithm>

#include "contract.h"

namespace ls {
namespace {

int64_t blocks_of(int64_t n) { return (n + kParamBlock - 1) / kParamBlock; }

}  // namespace

Shard ParamPlacement::shard(const ParamInfo& p, int data) const {
  const int64_t nb = blocks_of(p.size);
  if (!sharded(p)) return {0, nb};
  const int group = mesh_.shard_group(), pos = data % group;
  return {nb * pos / group, nb * (pos + 1) / group};
}

std::vector<size_t> ParamPlacement::shard_elems(int64_t n, int g) {
  const int64_t nb = blocks_of(n);
  std::vector<size_t> out(g);
  for (int q = 0; q < g; ++q)
    out[q] = (size_t)(std::min(n, nb * (q + 1) / g * kParamBlock) - std::min(n, nb * q / g * kParamBlock));
  return out;
}

bool ParamPlacement::counts_in_state(int rank, const ParamInfo& p) const {
  const MeshConfig::RankCoords at = mesh_.rank_coords(rank);
  if (!first_of_context_and_tensor(at, p)) return false;
  if (p.expert && mesh_.ep > 1) return at.data < mesh_.ep;  // the first expert-parallel group's slices
  if (sharded(p)) return at.data < mesh_.shard_group();    // the first replica's shards
  return at.data == 0;
}

bool ParamPlacement::writes_checkpoint(int rank, size_t t, const ParamInfo& p) const {
  const MeshConfig::RankCoords at = mesh_.rank_coords(rank);
  if (!first_of_context_and_tensor(at, p)) return false;
  if ((p.expert && mesh_.ep > 1) || sharded(p) || p.tp_mid > 0) return counts_in_state(rank, p);
  // Replicated over the data-parallel ranks: any copy will do; spread the writers by tensor.
  return at.data == (int)(t % mesh_.dp);
}

bool ParamPlacement::first_of_context_and_tensor(const MeshConfig::RankCoords& at, const ParamInfo& p) {
  // Context-parallel ranks keep copies, and so do tensor-parallel ranks of what they do not split.
  return at.context == 0 && (at.tensor == 0 || p.tp_mid > 0);
}

void assemble_tp_parts(const ParamInfo& p, const float* parts, int tp, float* whole) {
  ParamInfo q = p;
  q.global_offset = 0;
  for (int rank = 0; rank < tp; ++rank) {
    q.tp_first = p.tp_held() * rank;
    const float* part = parts + (int64_t)rank * p.size;
    for (int64_t i = 0; i < p.size; ++i) whole[q.global_index(i)] = part[i];
  }
}

void gather_tp_tensor(const ParamInfo& p, bool sharded, Communicator& shard, Communicator& tensor, const float* mine,
                      ops::DeviceVector<float>& held, ops::DeviceVector<float>& parts, ops::DeviceVector<float>& whole) {
  const float* part = mine;
  if (sharded) {
    held.resize(p.size);
    gather_shards(shard, p.size, mine, held.data());
    part = held.data();
  }
  parts.resize((size_t)p.size * tensor.size());
  all_gather_equal(tensor, part, parts.data(), (size_t)p.size * sizeof(float));
  whole.resize(parts.size());
  assemble_tp_parts(p, parts.data(), tensor.size(), whole.data());
}

void gather_shards(Communicator& shard, int64_t n, const float* mine, float* whole) {
  std::vector<size_t> bytes = ParamPlacement::shard_elems(n, shard.size());
  for (size_t& b : bytes) b *= sizeof(float);
  shard.all_gather(mine, whole, bytes);
}

}  // namespace ls
