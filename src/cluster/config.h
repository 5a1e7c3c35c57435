// The simulated cluster's layout (scenario keys mesh.*), as a table of axes.
//
// Four axes multiply into the world: pipeline stages (pp), data-parallel
// ranks (dp), context-parallel ranks (cp) and tensor-parallel ranks (tp),
// laid out in that order, major to minor (kRankAxes). Expert parallelism
// (ep) and FSDP/HSDP shards (fsdp, replicate) subdivide the data axis; they
// add groups, not ranks. Every predicate and description of a mesh is
// written here once, from the table.
#pragma once

#include <array>
#include <string>

namespace ls {

// The order a pipeline stage runs its microbatches in (mesh.pp_schedule).
enum class PipelineSchedule { kGpipe, k1f1b, kInterleaved };
// Which positions each context-parallel rank holds (mesh.cp_layout).
enum class CpLayout { kZigzag, kContiguous };

// mesh.pp_schedule's and mesh.cp_layout's values; UserError naming the key otherwise.
PipelineSchedule parse_pipeline_schedule(const std::string& name);
CpLayout parse_cp_layout(const std::string& name);

// A mesh axis, and the group of ranks along it (cluster/mesh.h). The first
// four multiply into the world, in rank order (major first); the others
// are groups inside it: expert parallelism and FSDP subdivide the data axis.
enum class Axis {
  kPipeline,    // the stages of one (data, context, tensor) index (mesh.pp)
  kData,        // the data-parallel ranks of one (stage, context, tensor) index (mesh.dp)
  kContext,     // the context-parallel ranks of one data-parallel rank (mesh.cp)
  kTensor,      // the tensor-parallel ranks of one data-parallel rank (mesh.tp)
  kExpert,      // data-parallel ranks sharing the experts (mesh.ep): consecutive ones, or under a wider
                // mesh.etp the same place of consecutive token groups (kExpertTokens)
  kExpertData,  // the data-parallel ranks holding the same experts' same slice, one per expert group
  kShard,       // the ranks splitting the state (MeshConfig::shard_group): an FSDP shard group of mesh.dp /
                // mesh.replicate consecutive data-parallel ranks, or the sharded optimizer's (a node's)
  kReplica,     // the ranks holding the same shard, one per shard group (HSDP's replicas, dp_node's nodes)
  kDataTensor,  // the data x tensor-parallel ranks of one (stage, context) index: under sequence
                // parallel, what a sum over the stream's tokens spans (Mesh::stream_group)
  kNode,        // mesh.dp_node consecutive data-parallel ranks: the ranks of one node, whose
                // gradients meet first (the inner level of the two-level all-reduce)
  kAcrossNodes, // the data-parallel ranks at the same place in every node: the outer level
  kExpertTensor,         // mesh.etp consecutive tensor-parallel ranks: the routed experts' hidden features
                         // split over them (as Megatron-Core's expert tensor parallelism)
  kExpertTensorReplica,  // the tensor-parallel ranks holding the same slice of the experts (mesh.tp / mesh.etp)
  kExpertTokens,  // mesh.etp wider than mesh.tp: the mesh.etp / mesh.tp consecutive data-parallel ranks whose
                  // tokens the routed experts take as one batch (one rank otherwise)
};
constexpr int kRankAxisCount = 4;
constexpr int kAxisCount = 14;

struct MeshConfig {
  int dp = 1;          // data-parallel ranks: each holds batch/dp consecutive samples
  int ep = 1;          // expert-parallel group size: consecutive data-parallel ranks sharing the experts
  bool fsdp = false;   // shard parameters, gradients and optimizer state (ZeRO-3 style)
  int replicate = 1;   // with fsdp: replica groups (HSDP); shards span dp/replicate ranks
  // Without fsdp, dp > 1: each data rank updates only its block share of
  // every tensor (ZeRO-1: gradients reduce-scattered, AdamW state sharded,
  // weights all-gathered); the bits are the replicated update's.
  bool shard_optimizer = true;
  int tp = 1;          // tensor-parallel ranks per data-parallel rank (heads and hidden features split)
  // Expert tensor parallelism: the routed experts' hidden features split
  // over this many ranks, apart from attention's mesh.tp (0: mesh.tp). A
  // divisor of mesh.tp: consecutive tensor ranks, each group computing its
  // slices on every token. A multiple: mesh.etp / mesh.tp consecutive
  // data-parallel ranks' tensor groups, whose tokens the experts take as one
  // batch (kExpertTokens).
  int etp = 0;
  bool sp = false;     // sequence parallel: with tp, norms, residuals, router and head on tokens split across tp
  int pp = 1;          // pipeline stages: each holds a contiguous range of the model's blocks
  std::string pp_schedule = "1f1b";  // gpipe | 1f1b | interleaved: the order a stage runs its microbatches in
  int pp_virtual = 1;  // interleaved: model chunks per stage
  int cp = 1;          // context-parallel ranks per data-parallel rank: attention's query positions split across them
  std::string cp_layout = "zigzag";  // zigzag | contiguous: which positions each context-parallel rank holds
  int dp_node = 1;     // data-parallel ranks per node: gradients all-reduced inside a node, then across nodes
  bool overlap = true;  // collectives started during the backward (and before the forward), waited for later
  // Ranks that share a host's memory (threads, or MPI processes of one node)
  // hand data over in place: a shard group shares one weights buffer and folds
  // its gradients from the ranks' buffers (runner/cluster_shared.cc), a tensor
  // group's chain goes through a shared slot (cluster/shared_chain.h).
  bool shared_memory = true;

  // One row per axis that multiplies into the world, in rank order.
  struct AxisRow {
    Axis axis;
    const char* name;       // "dp": the key is "mesh." + name
    int MeshConfig::*size;  // its degree
  };
  static constexpr std::array<AxisRow, kRankAxisCount> kRankAxes = {{
      {Axis::kPipeline, "pp", &MeshConfig::pp},
      {Axis::kData, "dp", &MeshConfig::dp},
      {Axis::kContext, "cp", &MeshConfig::cp},
      {Axis::kTensor, "tp", &MeshConfig::tp},
  }};
  // Ranks in a group along axis a.
  int size(Axis a) const;

  // Ranks in the world: the product of the rank axes.
  int world() const;
  // More than one rank, or a split the one-rank engine does not run
  // (expert parallel, FSDP, or microbatches through a pipeline).
  bool multi_rank(int microbatches) const;
  // A pipeline runs the step: several stages, or several microbatches.
  bool pipelined(int microbatches) const { return pp > 1 || microbatches > 1; }
  // The same model on one rank: every axis at 1, every switch off (what
  // bisect's twin runs; the bits must not change).
  static MeshConfig single_rank() { return MeshConfig{}; }
  // "dp 2, ep 2, tp 2 + sp, cp 4 zigzag, pp 2 1f1b, 4 microbatches, fsdp
  // replicate 2": every axis above 1 and every switch on, in one form used
  // by every tool; "one rank" when there is none.
  std::string describe(int microbatches) const;
  // "mesh.dp x mesh.tp x mesh.pp = 4 x 1 x 2 = 8" (and "x mesh.cp" when it
  // is above 1), for messages.
  std::string world_formula() const;
  PipelineSchedule schedule() const { return parse_pipeline_schedule(pp_schedule); }
  CpLayout layout() const { return parse_cp_layout(cp_layout); }

  // Where world rank r sits, one coordinate per rank axis:
  // r = ((stage * dp + data) * cp + context) * tp + tensor. Tensor-parallel
  // ranks are neighbours, then context-parallel ranks, then data-parallel
  // ones; a pipeline stage is a contiguous block of ranks.
  struct RankCoords {
    int stage = 0, data = 0, context = 0, tensor = 0;
  };
  RankCoords rank_coords(int r) const;
  // The place of the rank at `c` in its group along axis a (cluster/mesh.h
  // orders every group by world rank).
  int rank_along(Axis a, const RankCoords& c) const;
  int ranks_per_stage() const { return dp * cp * tp; }
  // The routed experts' hidden split: mesh.etp, or mesh.tp when it is 0.
  int expert_tp() const { return etp > 0 ? etp : tp; }
  // The data-parallel ranks whose tokens the routed experts take as one
  // batch: mesh.etp / mesh.tp where mesh.etp is wider, else 1.
  int expert_token_group() const { return expert_tp() > tp ? expert_tp() / tp : 1; }
  // The axis that splits the routed experts' hidden features: kTensor when
  // it is attention's split too, else kExpertTensor.
  Axis expert_tensor_axis() const { return expert_tp() == tp ? Axis::kTensor : Axis::kExpertTensor; }
  // Ranks that split each tensor's AdamW state and update: an FSDP shard
  // group; under shard_optimizer the data axis, or with nodes (dp_node) a
  // node's ranks, the state replicated across nodes as HSDP's across replicas
  // (the node's aligned subtree, then the tree over nodes: the same tree);
  // 1 when the state is replicated.
  int shard_group() const { return fsdp ? dp / replicate : !shard_optimizer ? 1 : dp_node > 1 ? dp_node : dp; }
  // Some tensors' state is split by block shares (FSDP, or shard_optimizer at dp > 1).
  bool shards_state() const { return fsdp || shard_group() > 1; }
};

}  // namespace ls
