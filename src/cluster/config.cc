// MeshConfig: every predicate over the axes, written once.
#include "cluster/config.h"

#include <algorithm>

#include "common/error.h"

namespace ls {

PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  if (name == "gpipe") return PipelineSchedule::kGpipe;
  if (name == "1f1b") return PipelineSchedule::k1f1b;
  if (name == "interleaved") return PipelineSchedule::kInterleaved;
  throw UserError("mesh.pp_schedule: must be gpipe, 1f1b or interleaved, got \"" + name + "\"");
}

CpLayout parse_cp_layout(const std::string& name) {
  if (name == "zigzag") return CpLayout::kZigzag;
  if (name == "contiguous") return CpLayout::kContiguous;
  throw UserError("mesh.cp_layout: must be zigzag or contiguous, got \"" + name + "\"");
}

int MeshConfig::size(Axis a) const {
  switch (a) {
    case Axis::kExpert: return ep;
    case Axis::kExpertData: return dp / (ep * expert_token_group());
    case Axis::kShard: return shard_group();
    case Axis::kReplica: return dp / shard_group();
    case Axis::kDataTensor: return dp * tp;
    case Axis::kNode: return dp_node;
    case Axis::kAcrossNodes: return dp / dp_node;
    case Axis::kExpertTensor: return expert_tp();
    case Axis::kExpertTensorReplica: return std::max(1, tp / expert_tp());
    case Axis::kExpertTokens: return expert_token_group();
    default: return this->*kRankAxes[(size_t)a].size;
  }
}

int MeshConfig::rank_along(Axis a, const RankCoords& c) const {
  switch (a) {
    case Axis::kPipeline: return c.stage;
    case Axis::kData: return c.data;
    case Axis::kContext: return c.context;
    case Axis::kTensor: return c.tensor;
    case Axis::kExpert: return c.data / expert_token_group() % ep;
    case Axis::kExpertData: return c.data / (ep * expert_token_group());
    case Axis::kShard: return c.data % shard_group();
    case Axis::kReplica: return c.data / shard_group();
    case Axis::kDataTensor: return c.data * tp + c.tensor;
    case Axis::kNode: return c.data % dp_node;
    case Axis::kAcrossNodes: return c.data / dp_node;
    case Axis::kExpertTensor:
      return expert_tp() <= tp ? c.tensor % expert_tp() : c.data % expert_token_group() * tp + c.tensor;
    case Axis::kExpertTensorReplica: return expert_tp() <= tp ? c.tensor / expert_tp() : 0;
    case Axis::kExpertTokens: return c.data % expert_token_group();
  }
  return 0;
}

int MeshConfig::world() const {
  int n = 1;
  for (const AxisRow& a : kRankAxes) n *= this->*a.size;
  return n;
}

bool MeshConfig::multi_rank(int microbatches) const {
  return world() > 1 || ep > 1 || fsdp || microbatches > 1;
}

std::string MeshConfig::describe(int microbatches) const {
  std::string out;
  auto add = [&](const std::string& part) { out += (out.empty() ? "" : ", ") + part; };
  if (dp > 1) add("dp " + std::to_string(dp) + (dp_node > 1 ? " in nodes of " + std::to_string(dp_node) : ""));
  if (ep > 1) add("ep " + std::to_string(ep));
  if (tp > 1) add("tp " + std::to_string(tp) + (sp ? " + sp" : ""));
  if (expert_tp() != tp) add("etp " + std::to_string(expert_tp()));
  if (cp > 1) add("cp " + std::to_string(cp) + " " + cp_layout);
  if (pipelined(microbatches))
    add("pp " + std::to_string(pp) + " " + pp_schedule + (pp_virtual > 1 ? " x" + std::to_string(pp_virtual) : ""));
  if (microbatches > 1) add(std::to_string(microbatches) + " microbatches");
  if (fsdp) add(replicate > 1 ? "fsdp replicate " + std::to_string(replicate) : "fsdp");
  else if (dp > 1 && !shard_optimizer) add("replicated optimizer");
  return out.empty() ? "one rank" : out;
}

std::string MeshConfig::world_formula() const {
  std::string keys, sizes;
  for (Axis a : {Axis::kData, Axis::kTensor, Axis::kPipeline, Axis::kContext}) {
    const AxisRow& row = kRankAxes[(size_t)a];
    if (a == Axis::kContext && size(a) == 1) continue;  // named only where it is used
    keys += std::string(keys.empty() ? "" : " x ") + "mesh." + row.name;
    sizes += (sizes.empty() ? "" : " x ") + std::to_string(size(a));
  }
  return keys + " = " + sizes + " = " + std::to_string(world());
}

MeshConfig::RankCoords MeshConfig::rank_coords(int r) const {
  int c[kRankAxisCount];
  for (int i = kRankAxisCount - 1; i >= 0; --i) {  // minor axis first
    const int n = this->*kRankAxes[(size_t)i].size;
    c[i] = r % n;
    r /= n;
  }
  return {c[(int)Axis::kPipeline], c[(int)Axis::kData], c[(int)Axis::kContext], c[(int)Axis::kTensor]};
}

}  // namespace ls
