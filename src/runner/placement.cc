#include "runner/placement.h"

#include <algorithm>
#include <stdexcept>

#include "contract.h"
#include "ops/ops.h"

namespace ls {
namespace {

int64_t blocks_of(int64_t n) { return (n + kParamBlock - 1) / kParamBlock; }

}  // namespace

std::pair<int64_t, int64_t> elements_of(const Shard& s, int64_t n) {
  return {std::min(n, s.b0 * kParamBlock), std::min(n, s.b1 * kParamBlock)};
}

Shard block_share(int64_t nb, int q, int g) { return {nb * q / g, nb * (q + 1) / g}; }

float shared_blocks_sumsq(Communicator& group, int64_t n, const float* mine, std::vector<float>& own,
                          std::vector<float>& sums) {
  const int g = group.size();
  const int64_t nb = blocks_of(n);
  const auto [lo, hi] = elements_of(block_share(nb, group.rank(), g), n);
  own.resize((size_t)blocks_of(hi - lo));
  if (!own.empty()) ops::param_block_sumsqs(mine, hi - lo, own.data());
  std::vector<size_t> bytes((size_t)g);
  for (int q = 0; q < g; ++q) {
    const Shard s = block_share(nb, q, g);
    bytes[(size_t)q] = (size_t)(s.b1 - s.b0) * sizeof(float);
  }
  sums.resize((size_t)nb);
  group.all_gather(own.data(), sums.data(), bytes);
  return tree_sum(sums.data(), nb);
}

namespace {

// The one place a tensor's reduction, state sharding and norm are decided.
TensorPlacement place(const MeshConfig& m, const ParamInfo& p, bool pipelined) {
  TensorPlacement t;
  // A routed expert's tensor that only some data-parallel ranks hold (a slice of the experts, or under a
  // wider mesh.etp a slice of their hidden features): reduced over the ranks holding the same piece.
  const bool expert_slice = p.expert && (p.split_over(Axis::kExpert) || m.expert_token_group() > 1);
  const bool tensor_split = p.split_over(Axis::kTensor);
  const bool expert_tensor_split = p.split_over(Axis::kExpertTensor);
  t.sharded = m.shards_state() && !expert_slice;
  // Sequence parallel: a tensor the stream's tokens reduce into (embeddings, norms, router, head) has a
  // partial per TP rank; the TP group's leaves are consecutive aligned blocks (tp a power of two wherever
  // dp > 1), so its tree over TP ranks is this data-parallel rank's subtree, combined below as without SP.
  // (A pipeline does this per microbatch, before its tree over microbatches.)
  if (m.sp && p.sums_stream_tokens() && !pipelined) t.reduce.push_back({Axis::kTensor, Collective::kAllReduce});
  if (expert_slice) {  // the replicas of these experts, one per expert-parallel group
    t.reduce.push_back({Axis::kExpertData, Collective::kAllReduce});
    t.copies.push_back(Axis::kExpertData);
  } else if (t.sharded) {  // each shard group's sum, then across the groups: HSDP's replicas, dp_node's nodes
    // (a node's aligned subtree, then the tree over nodes); one rank where the group spans the data axis
    t.reduce.push_back({Axis::kShard, Collective::kReduceScatter});
    t.reduce.push_back({Axis::kReplica, Collective::kAllReduce});
    t.copies.push_back(Axis::kReplica);
  } else if (m.dp_node > 1) {  // replicated state: a node's aligned subtree, then the tree over nodes
    t.reduce.push_back({Axis::kNode, Collective::kAllReduce});
    t.reduce.push_back({Axis::kAcrossNodes, Collective::kAllReduce});
    t.copies.push_back(Axis::kData);
  } else {
    t.reduce.push_back({Axis::kData, Collective::kAllReduce});
    t.copies.push_back(Axis::kData);
  }
  // Context-parallel ranks keep copies, and so do tensor-parallel ranks of what they do not split (of the
  // experts' slices under mesh.etp: the tensor ranks of the other slices' groups).
  t.copies.push_back(Axis::kContext);
  if (expert_tensor_split) t.copies.push_back(Axis::kExpertTensorReplica);
  else if (!tensor_split) t.copies.push_back(Axis::kTensor);
  if (tensor_split && !expert_slice && !t.sharded) t.norm = NormFold::kSplitChain;
  else if (tensor_split || expert_tensor_split || expert_slice) t.norm = NormFold::kGatherWhole;
  else if (t.sharded) t.norm = NormFold::kShardBlocks;
  return t;
}

}  // namespace

PlacementPlan::PlacementPlan(const MeshConfig& mesh, const std::vector<ParamInfo>& tensors, bool pipelined)
    : mesh_(mesh) {
  for (const ParamInfo& p : tensors) {
    if ((size_t)p.index != tensors_.size()) throw std::logic_error("PlacementPlan: tensors not in canonical order");
    tensors_.push_back(place(mesh, p, pipelined));
  }
}

Shard PlacementPlan::shard(const ParamInfo& p, int data) const {
  const int64_t nb = blocks_of(p.size);
  if (!sharded(p)) return {0, nb};
  const int group = mesh_.shard_group();
  return block_share(nb, data % group, group);
}

std::vector<size_t> PlacementPlan::shard_elems(int64_t n, int g) {
  std::vector<size_t> out(g);
  for (int q = 0; q < g; ++q) {
    const auto [lo, hi] = elements_of(block_share(blocks_of(n), q, g), n);
    out[q] = (size_t)(hi - lo);
  }
  return out;
}

bool PlacementPlan::counts_in_state(int rank, const ParamInfo& p) const {
  const MeshConfig::RankCoords at = mesh_.rank_coords(rank);
  for (Axis a : of(p).copies)
    if (mesh_.rank_along(a, at) != 0) return false;
  return true;
}

bool PlacementPlan::writes_checkpoint(int rank, size_t t, const ParamInfo& p) const {
  const TensorPlacement& tp = of(p);
  if (tp.copies.front() != Axis::kData || p.feature_split()) return counts_in_state(rank, p);
  // Replicated over the data-parallel ranks: any copy will do; spread the writers by tensor.
  const MeshConfig::RankCoords at = mesh_.rank_coords(rank);
  for (Axis a : tp.copies)
    if (a != Axis::kData && mesh_.rank_along(a, at) != 0) return false;
  return at.data == (int)(t % mesh_.dp);
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

namespace {

// fn(g, n, holder, local) for each run of a split tensor's global elements
// [lo, hi) that one TP rank holds contiguously: n elements from global index
// g, held by TP rank `holder` from its element `local` on. In the
// [outer, mid, inner] view a rank holds `held` consecutive middle indices,
// so its runs are held x inner elements long.
template <class Fn>
void for_each_run(const ParamInfo& p, int64_t lo, int64_t hi, Fn&& fn) {
  const TensorSplit& s = *p.feature_split();
  const int64_t inner = s.inner, held = s.held(), row = s.mid * inner, span = held * inner;
  for (int64_t g = lo; g < hi;) {
    const int64_t o = g / row, within = g - o * row;
    const int holder = (int)(within / span);
    const int64_t end = std::min(hi, o * row + (holder + 1) * span);
    fn(g, end - g, holder, o * span + within - holder * span);
    g = end;
  }
}

}  // namespace

void assemble_tp_parts(const ParamInfo& p, const float* parts, int tp, float* whole) {
  for_each_run(p, 0, p.size * tp, [&](int64_t g, int64_t len, int holder, int64_t local) {
    std::copy(parts + (int64_t)holder * p.size + local, parts + (int64_t)holder * p.size + local + len, whole + g);
  });
}

void gather_tp_range(const ParamInfo& p, Communicator& tensor, const float* part, const TpRangeOf& range_of,
                     TpRangeBuffers& b, std::vector<float>& mine) {
  const int tp = tensor.size(), me = tensor.rank();
  // Send each rank the elements of its range this rank holds, in global order.
  std::vector<float>& send = b.send;
  send.clear();
  std::vector<size_t> send_bytes((size_t)tp, 0), recv_bytes((size_t)tp, 0);
  for (int q = 0; q < tp; ++q) {
    const auto [lo, hi] = range_of(q);
    const size_t before = send.size();
    for_each_run(p, lo, hi, [&](int64_t, int64_t len, int holder, int64_t local) {
      if (holder == me) send.insert(send.end(), part + local, part + local + len);
    });
    send_bytes[(size_t)q] = (send.size() - before) * sizeof(float);
  }
  const auto [lo, hi] = range_of(me);
  for_each_run(p, lo, hi, [&](int64_t, int64_t len, int holder, int64_t) {
    recv_bytes[(size_t)holder] += (size_t)len * sizeof(float);
  });
  std::vector<float>& recv = b.recv;
  recv.resize((size_t)(hi - lo));
  tensor.all_to_all(send.data(), send_bytes, recv.data(), recv_bytes);
  // Received by source rank; put each run back at its global place.
  mine.resize((size_t)(hi - lo));
  std::vector<size_t> at((size_t)tp, 0);
  for (int r = 1; r < tp; ++r) at[(size_t)r] = at[(size_t)r - 1] + recv_bytes[(size_t)r - 1] / sizeof(float);
  for_each_run(p, lo, hi, [&](int64_t g, int64_t len, int holder, int64_t) {
    std::copy(recv.begin() + (int64_t)at[(size_t)holder], recv.begin() + (int64_t)at[(size_t)holder] + len,
              mine.begin() + (g - lo));
    at[(size_t)holder] += (size_t)len;
  });
}

namespace {

// This TP rank's pieces of a split tensor's parameter blocks, in block
// order. False when some block's runs are not held in ascending TP rank
// order (a chain through the ranks in order could not carry its fold).
bool chain_pieces(const ParamInfo& p, int tp, int me, std::vector<BlockPiece>& mine) {
  const int64_t n = p.size * tp;
  std::vector<int> last_holder((size_t)blocks_of(n), -1);
  bool ascending = true;
  mine.clear();
  for_each_run(p, 0, n, [&](int64_t g, int64_t len, int holder, int64_t local) {
    for (int64_t at = g; at < g + len;) {  // the run cut at block boundaries
      const int64_t block = at / kParamBlock, end = std::min(g + len, (block + 1) * kParamBlock);
      ascending = ascending && last_holder[(size_t)block] < holder;
      last_holder[(size_t)block] = holder;
      if (holder == me) mine.push_back({block, local + (at - g), end - at});
      at = end;
    }
  });
  return ascending;
}

// Continues acc[block] over each piece: runs of pieces of equal length that
// follow each other in the part and in block order fold side by side.
void fold_pieces(const float* part, const std::vector<BlockPiece>& pieces, float* acc) {
  for (size_t i = 0; i < pieces.size();) {
    const BlockPiece& first = pieces[i];
    size_t j = i + 1;
    while (j < pieces.size() && pieces[j].len == first.len && pieces[j].block == first.block + (int64_t)(j - i) &&
           pieces[j].local == first.local + (int64_t)(j - i) * first.len)
      ++j;
    ops::param_piece_sumsqs(part + first.local, (int64_t)(j - i), first.len, acc + first.block);
    i = j;
  }
}

}  // namespace

float split_tensor_sumsq(const ParamInfo& p, Communicator& tensor, const float* part, SplitNormBuffers& b,
                         bool* last_rank_only) {
  const int tp = tensor.size(), me = tensor.rank();
  const int64_t n = p.size * tp, nb = blocks_of(n);
  if (last_rank_only && chain_pieces(p, tp, me, b.pieces)) {
    // The chain: each block's fold starts at +0 on TP rank 0 and is carried on, rank by rank, over the pieces
    // each holds (their runs come in ascending rank order): what travels is one float per block.
    b.sums.assign((size_t)nb, 0.0f);
    if (me > 0) tensor.recv(b.sums.data(), sizeof(float) * (size_t)nb, me - 1, "norm_chain");
    fold_pieces(part, b.pieces, b.sums.data());
    *last_rank_only = true;
    if (me + 1 < tp) {
      tensor.send(b.sums.data(), sizeof(float) * (size_t)nb, me + 1, "norm_chain");
      return 0.0f;
    }
    return tree_sum(b.sums.data(), nb);
  }
  if (last_rank_only) *last_rank_only = false;
  // Rank q's blocks, as elements.
  gather_tp_range(p, tensor, part, [&](int q) { return elements_of(block_share(nb, q, tp), n); }, b.range, b.mine);
  return shared_blocks_sumsq(tensor, n, b.mine.data(), b.own, b.sums);
}

namespace {
std::vector<size_t> shard_bytes(int64_t n, int g) {
  std::vector<size_t> bytes = PlacementPlan::shard_elems(n, g);
  for (size_t& b : bytes) b *= sizeof(float);
  return bytes;
}
}  // namespace

void gather_shards(Communicator& shard, int64_t n, const float* mine, float* whole) {
  shard.all_gather(mine, whole, shard_bytes(n, shard.size()));
}

Pending start_gather_shards(Communicator& shard, int64_t n, const float* mine, float* whole) {
  return shard.start_all_gather(mine, whole, shard_bytes(n, shard.size()));
}

}  // namespace ls
