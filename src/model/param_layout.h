// The model's parameter tensors and where each lives on a mesh: a Shard
// placement per mesh axis that splits it (PyTorch DTensor's vocabulary),
// replicated along every other axis. The model declares what each tensor is
// (its parallel style: a head or hidden-feature column or row, an expert
// slice); the mesh decides how many parts each axis makes. The runner's
// placement plan (runner/placement.h) derives reductions, norm, hash,
// checkpoints and memory from these splits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cluster/config.h"
#include "model/config.h"

namespace ls {

// One mesh axis's Shard placement of a tensor: viewing what the splits
// before it left of the tensor as [outer, mid, inner], each of the axis's
// `parts` ranks holds mid / parts consecutive middle indices, this one
// from `first`.
struct TensorSplit {
  Axis axis = Axis::kTensor;
  int parts = 1;
  int64_t outer = 1, mid = 0, inner = 1, first = 0;
  int64_t held() const { return mid / parts; }  // the middle indices held
};

// One named parameter tensor inside the flat parameter array.
struct ParamInfo {
  std::string name;
  int index = 0;                      // in the canonical order of all the model's tensors (a pipeline stage holds some)
  std::vector<int64_t> shape;         // as held here (what the splits leave of the tensor)
  std::vector<int64_t> global_shape;  // the whole tensor
  int64_t global_offset = 0;          // first element of the held expert slice inside the whole tensor (kExpert split)
  int64_t offset = 0;                 // into the flat arrays
  int64_t size = 0;
  bool decay = true;                  // AdamW weight decay applies (matrices, not norms)
  bool expert = false;                // a routed-expert tensor (sliced by expert parallelism)
  // The Shard placements, outermost first: the expert slice (kExpert, a
  // contiguous range of experts), then the split of heads or hidden features
  // (kTensor; a routed expert's hidden features: kExpertTensor when mesh.etp
  // differs from mesh.tp). An axis absent here replicates the tensor.
  std::vector<TensorSplit> splits;

  // The split of heads or hidden features, or nullptr: the held elements are
  // then contiguous in the whole tensor (from global_offset).
  const TensorSplit* feature_split() const;
  TensorSplit* feature_split() { return const_cast<TensorSplit*>(static_cast<const ParamInfo*>(this)->feature_split()); }
  bool split_over(Axis a) const;
  // A fold over the stream's tokens lands in it whole on every tensor rank
  // (embeddings, norms, router, head: neither split by the tensor group nor
  // a routed expert's, which every tensor rank computes on every token), so
  // under sequence parallel each TP rank holds a partial of it.
  bool sums_stream_tokens() const { return !expert && !split_over(Axis::kTensor); }
  // The element of the whole tensor that held element `i` is.
  int64_t global_index(int64_t i) const;
  // Held elements [first, first + n) as runs contiguous in both: fn(global
  // element, offset from `first`, count), in held order.
  template <class Fn>
  void for_each_global_run(int64_t first, int64_t n, Fn fn) const {
    const TensorSplit* s = feature_split();
    const int64_t block = s ? s->held() * s->inner : n;  // held elements contiguous in the whole
    for (int64_t i = 0; i < n;) {
      const int64_t count = s ? std::min(n - i, block - (first + i) % block) : n;
      fn(global_index(first + i), i, count);
      i += count;
    }
  }
};

// Every tensor of the model in canonical (bytewise name) order, as the rank
// at `at` of `mesh` holds it; offsets as if it held all of them. One rank:
// MeshConfig{} and its coordinates. UserError when the mesh cannot split
// the model (experts over mesh.ep, heads and hidden features over mesh.tp,
// the experts' hidden features over mesh.etp).
std::vector<ParamInfo> place_params(const ModelConfig& cfg, const MeshConfig& mesh, const MeshConfig::RankCoords& at);

// Weights one rank of `mesh` holds (an expert-parallel rank holds E / ep
// experts; a tensor-parallel rank 1/tp of the split tensors).
int64_t count_weights(const ModelConfig& cfg, const MeshConfig& mesh);

}  // namespace ls
