// Where every piece of every parameter tensor lives on a mesh: FSDP shards,
// expert-parallel slices, tensor-parallel parts, and the copies the other
// axes keep. One answer for the training step, the gradient norm, the
// state hash, checkpoint staging and restore.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "cluster/communicator.h"
#include "cluster/config.h"
#include "model/model.h"
#include "ops/device_memory.h"

namespace ls {

// An FSDP shard of one tensor: the block range [b0, b1) of kParamBlock blocks.
struct Shard {
  int64_t b0 = 0, b1 = 0;
};

// The elements [lo, hi) of an n-element tensor that blocks `s` cover.
std::pair<int64_t, int64_t> elements_of(const Shard& s, int64_t n);

// Blocks [b0, b1) of nb that rank q of a group of g takes: the one split of a
// tensor's kParamBlock blocks between ranks (FSDP shards, the gradient
// norm's shares), consecutive and in rank order.
Shard block_share(int64_t nb, int q, int g);

// The sum of squares of an n-element tensor whose kParamBlock blocks the
// ranks of `group` share (block_share), as ops::param_sumsq folds the whole:
// `mine` holds this rank's blocks' elements in order; their folds are
// all-gathered and the tree over blocks taken. own, sums: buffers reused.
float shared_blocks_sumsq(Communicator& group, int64_t n, const float* mine, std::vector<float>& own,
                          std::vector<float>& sums);

// One collective of a gradient's reduction: a sum over one axis's group.
enum class Collective { kAllReduce, kReduceScatter };
struct ReduceStep {
  Axis axis = Axis::kData;
  Collective op = Collective::kAllReduce;
};

// How the gradient norm folds a tensor's reduced gradient, as
// AdamW::global_norm folds the whole tensor (blocks of kParamBlock, the
// canonical tree over blocks).
enum class NormFold {
  kHeld,         // held whole here: folded here
  kShardBlocks,  // block shares of the shard group: their block folds all-gathered (shared_blocks_sumsq)
  kSplitChain,   // parts of the tensor group: the blocks' folds chained through it (split_tensor_sumsq)
  kGatherWhole,  // the pieces gathered (the tensor group's parts, then the expert slices) and folded whole
};

// One tensor's placement on the mesh, per axis (DTensor-style): the splits
// of ParamInfo::splits, the axis its state is sharded over, and what
// follows from them.
struct TensorPlacement {
  bool sharded = false;            // state in block shares over kShard (FSDP, the sharded optimizer), copies over kReplica
  std::vector<ReduceStep> reduce;  // the gradient's partial sums, combined in this order
  std::vector<Axis> copies;        // the axes along which ranks hold copies of the same piece of state
  NormFold norm = NormFold::kHeld;
};

// The placement plan: built once from the mesh and the model's tensors (as
// its first rank holds them), and the one answer for the training step's
// reductions (blocking and overlapped), the gradient norm, the weight
// gathers, the state hash, checkpoint staging and restore, and the memory plan.
class PlacementPlan {
 public:
  PlacementPlan() = default;
  // pipelined: a pipeline's stages sum sequence-parallel partials per microbatch themselves.
  PlacementPlan(const MeshConfig& mesh, const std::vector<ParamInfo>& tensors, bool pipelined);

  const TensorPlacement& of(const ParamInfo& p) const { return tensors_[(size_t)p.index]; }
  bool sharded(const ParamInfo& p) const { return of(p).sharded; }
  // The blocks of p that the rank at data-parallel index `data` keeps: its
  // shard group position's range, or all of them.
  Shard shard(const ParamInfo& p, int data) const;
  // Elements each rank of a shard group of g ranks keeps of an n-element tensor.
  static std::vector<size_t> shard_elems(int64_t n, int g);

  // World rank `rank`'s piece of p is the one the state counts: of the
  // copies, the first along every axis that keeps them (TensorPlacement::copies).
  bool counts_in_state(int rank, const ParamInfo& p) const;
  // World rank `rank` writes its piece of tensor t (canonical index t in its
  // stage) to a checkpoint: one writer per element, tensors replicated over
  // the data axis spread their writers over its ranks.
  bool writes_checkpoint(int rank, size_t t, const ParamInfo& p) const;

 private:
  MeshConfig mesh_;
  std::vector<TensorPlacement> tensors_;  // by canonical index
};

// whole = the tensor a tensor-parallel split tensor's parts make (its
// expert-parallel slice when experts are split too): part q (held by TP
// rank q, p.size elements each, concatenated) put in place.
void assemble_tp_parts(const ParamInfo& p, const float* parts, int tp, float* whole);

// whole = the whole of a tensor-parallel split tensor (its expert-parallel
// slice), from this rank's piece of its part `mine`: with FSDP the shard
// group's shards of the part gathered first (into held), then the tensor
// group's parts (into parts), put in place. Every rank of both groups takes
// part. The buffers are reused between calls.
void gather_tp_tensor(const ParamInfo& p, bool sharded, Communicator& shard, Communicator& tensor, const float* mine,
                      ops::DeviceVector<float>& held, ops::DeviceVector<float>& parts, ops::DeviceVector<float>& whole);

// The sum of squares of a tensor-parallel split tensor (the whole tensor,
// not an expert-parallel slice of it) as ops::param_sumsq folds the whole:
// blocks of kParamBlock in global order, then the canonical tree over
// blocks. Without assembling it: TP rank q folds blocks [nb q / tp, nb (q+1)
// / tp), receiving from the others just those blocks' elements (an
// all-to-all: every element travels at most once), and the block sums are
// all-gathered for the tree. `part`: this rank's part, p.size elements.
// b: buffers kept between calls (the all-to-all's, the block sums).
// mine = elements [lo, hi) = range_of(tensor.rank()) of the whole of a
// tensor-parallel split tensor (its expert-parallel slice), TP rank q asking
// for range_of(q): each rank sends each other rank just the elements of its
// range it holds (an all-to-all: every element travels at most once).
// `part`: this rank's part, p.size elements; b: buffers kept between calls.
struct TpRangeBuffers {
  std::vector<float> send, recv;
};
using TpRangeOf = std::function<std::pair<int64_t, int64_t>(int q)>;
void gather_tp_range(const ParamInfo& p, Communicator& tensor, const float* part, const TpRangeOf& range_of,
                     TpRangeBuffers& b, std::vector<float>& mine);

// A TP rank's piece of a split tensor's parameter block: `len` elements of
// block `block`, at `local` in the rank's part.
struct BlockPiece {
  int64_t block, local, len;
};
struct SplitNormBuffers {
  TpRangeBuffers range;
  std::vector<float> mine, own, sums;
  std::vector<BlockPiece> pieces;
};
// With last_rank_only, where every block's runs are held in ascending TP
// rank order (the model's split tensors), the blocks' folds are chained
// instead: TP rank 0 folds its piece of every block from +0 and sends the
// partials on, each rank continues them over its pieces (one float per
// block travels, no element), and only the group's last rank returns the
// sum (*last_rank_only set; the others return 0 and the caller shares it,
// so a rank goes on to its next tensor while the next rank folds this one).
float split_tensor_sumsq(const ParamInfo& p, Communicator& tensor, const float* part, SplitNormBuffers& b,
                         bool* last_rank_only = nullptr);

// whole = a tensor of n elements from its FSDP shards, each rank's block
// range (an all-gather over the shard group); started: in place once the
// Pending completes.
void gather_shards(Communicator& shard, int64_t n, const float* mine, float* whole);
Pending start_gather_shards(Communicator& shard, int64_t n, const float* mine, float* whole);

}  // namespace ls
