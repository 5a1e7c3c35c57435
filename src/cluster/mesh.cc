// Splitting the world into a rank's groups, one per axis.
#include "cluster/mesh.h"

#include <algorithm>

namespace ls {

Mesh::Mesh() {
  for (size_t a = 0; a < owned_.size(); ++a) {
    owned_[a] = solo_communicator();
    groups_[a] = owned_[a].get();
  }
}

int Mesh::group_color(const MeshConfig& cfg, Axis a, const MeshConfig::RankCoords& c) {
  MeshConfig::RankCoords fixed = c;
  const int ep = cfg.ep, shard = cfg.shard_group(), g = cfg.expert_token_group(), etp = cfg.expert_tp();
  switch (a) {
    case Axis::kPipeline: fixed.stage = 0; break;
    case Axis::kData: fixed.data = 0; break;
    case Axis::kContext: fixed.context = 0; break;
    case Axis::kTensor: fixed.tensor = 0; break;
    case Axis::kExpert: fixed.data = c.data / (g * ep) * (g * ep) + c.data % g; break;  // g = 1: consecutive
    case Axis::kExpertData: fixed.data = c.data / g % ep * g + c.data % g; break;
    case Axis::kShard: fixed.data = c.data / shard * shard; break;
    case Axis::kReplica: fixed.data = c.data % shard; break;
    case Axis::kDataTensor: fixed.data = 0, fixed.tensor = 0; break;
    case Axis::kNode: fixed.data = c.data / cfg.dp_node * cfg.dp_node; break;
    case Axis::kAcrossNodes: fixed.data = c.data % cfg.dp_node; break;
    case Axis::kExpertTensor:
      if (etp <= cfg.tp) fixed.tensor = c.tensor / etp * etp;
      else fixed.data = c.data / g * g, fixed.tensor = 0;
      break;
    case Axis::kExpertTensorReplica:
      if (etp <= cfg.tp) fixed.tensor = c.tensor % etp;
      break;  // wider: every rank its own slice
    case Axis::kExpertTokens: fixed.data = c.data / g * g; break;
  }
  return ((fixed.stage * cfg.dp + fixed.data) * cfg.cp + fixed.context) * cfg.tp + fixed.tensor;
}

Mesh::Mesh(const MeshConfig& cfg, Communicator& world)
    : sp_(cfg.sp && cfg.tp > 1), overlap_(cfg.overlap), cp_layout_(cfg.layout()),
      expert_tensor_axis_(cfg.expert_tensor_axis()) {
  const int me = world.rank();
  const MeshConfig::RankCoords at = cfg.rank_coords(me);
  // Ordered by world rank: along every group, by the varying coordinate.
  for (size_t a = 0; a < owned_.size(); ++a) {
    owned_[a] = world.split(group_color(cfg, (Axis)a, at), me);
    groups_[a] = owned_[a].get();
  }
}

std::vector<Communicator*> Mesh::communicators() const {
  std::vector<Communicator*> out;
  for (Communicator* c : groups_)
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  // A group set in place of its own (a wrapper, data lanes): its own still counts what goes through it.
  for (const auto& c : owned_)
    if (c && std::find(out.begin(), out.end(), c.get()) == out.end()) out.push_back(c.get());
  return out;
}

}  // namespace ls
