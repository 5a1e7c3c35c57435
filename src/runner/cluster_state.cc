// A cluster's state as one: the canonical state hash over every rank's
// pieces, and checkpoint staging and restore, each piece written once.
#include <algorithm>
#include <string>
#include <vector>

#include "cluster/communicator.h"
#include "contract.h"
#include "runner/cluster_rank.h"
#include "runner/cluster_trainer.h"

namespace ls {

// A piece of tensor t (canonical index) as the state hash places it: n
// elements from global element `start`, or of a tensor-parallel part (its
// first middle index tp_first >= 0) elements held_first .. held_first + n - 1
// of the held part (an FSDP shard of it), start = the part's tensor's first
// global element; with its weights and moments.
struct ClusterTrainer::StatePart {
  int64_t t = 0, start = 0, n = 0, tp_first = -1, held_first = 0;
  const float *w = nullptr, *m1 = nullptr, *m2 = nullptr;
  static constexpr int kHeader = 5;  // the integers above, as sent between processes
};

namespace {

// The global state's canonical hash from the ranks' pieces (contract rule
// 6: adam_m/<p>, adam_v/<p>, param/<p>, each tensor's little-endian bits),
// one tensor assembled at a time, so hashing holds one tensor beside the
// state rather than a copy of all of it.
std::string hash_pieces(const std::vector<ParamInfo>& all, const std::vector<ClusterTrainer::StatePart>& parts) {
  std::vector<std::vector<const ClusterTrainer::StatePart*>> of_tensor(all.size());
  for (const ClusterTrainer::StatePart& p : parts) of_tensor[(size_t)p.t].push_back(&p);
  StateHasher hs;
  std::vector<float> tensor;
  for (int kind = 0; kind < 3; ++kind)
    for (size_t t = 0; t < all.size(); ++t) {
      int64_t global = 1;
      for (int64_t d : all[t].global_shape) global *= d;
      tensor.assign((size_t)global, 0.0f);
      for (const ClusterTrainer::StatePart* p : of_tensor[t]) {
        const float* from = kind == 0 ? p->m1 : kind == 1 ? p->m2 : p->w;
        if (p->tp_first < 0) {
          std::copy(from, from + p->n, tensor.begin() + p->start);
          continue;
        }
        ParamInfo q = all[t];  // the part's view of the tensor
        q.global_offset = p->start;
        q.feature_split()->first = p->tp_first;
        q.for_each_global_run(p->held_first, p->n, [&](int64_t g, int64_t i, int64_t count) {
          std::copy(from + i, from + i + count, tensor.begin() + g);
        });
      }
      const char* prefix = kind == 0 ? "adam_m/" : kind == 1 ? "adam_v/" : "param/";
      hs.add(prefix + all[t].name, all[t].global_shape, tensor.data());
    }
  return hs.hex();
}

}  // namespace

// The pieces of rank r that count in the state (PlacementPlan::counts_in_state).
// gradients: w points at the reduced gradients instead (reduced_gradient).
std::vector<ClusterTrainer::StatePart> ClusterTrainer::state_parts(const Rank& rk, bool gradients) const {
  std::vector<StatePart> out;
  const auto& infos = rk.model->params();
  for (size_t t = 0; t < infos.size(); ++t) {
    const ParamInfo& q = infos[t];
    if (!placement_.counts_in_state(rk.index, q)) continue;
    const auto [lo, hi] = range(rk, t);
    const bool sharded = placement_.sharded(q);
    const float* w = gradients ? (sharded ? rk.reduced.data() + rk.sharded_off[t] : rk.model->grads() + q.offset + lo)
                               : (sharded ? master_shard(rk, t) : rk.model->weights() + q.offset + lo);
    const TensorSplit* split = q.feature_split();
    out.push_back({(int64_t)q.index, q.global_offset + (split ? 0 : lo), hi - lo, split ? split->first : -1,
                   split ? lo : 0, w, rk.m.data() + rk.shard_off[t], rk.v.data() + rk.shard_off[t]});
  }
  return out;
}

// Rank rk's pieces of the weights ("params") or of the reduced gradients
// ("grad") to the mesh trace, as flat element runs of the whole tensors.
void ClusterTrainer::trace_state(const Rank& rk, const char* phase) const {
  for (const StatePart& p : state_parts(rk, std::string(phase) == "grad")) {
    const ParamInfo& whole = all_tensors_[(size_t)p.t];
    TracePiece piece;
    if (p.tp_first < 0) {
      piece.rows.push_back({p.start, 0, p.n});
    } else {
      ParamInfo q = whole;  // the part's view of the tensor, as hash_pieces places it
      q.global_offset = p.start;
      q.feature_split()->first = p.tp_first;
      q.for_each_global_run(p.held_first, p.n,
                            [&](int64_t g, int64_t i, int64_t count) { piece.rows.push_back({g, i, count}); });
    }
    mesh_trace_->add(rk.index, phase, -1, "param", whole.name.c_str(), p.w, whole.global_shape, piece);
  }
}

// Under MPI every process sends its parts to every other (an all-gather of
// headers, then of the data), so each places the same global state. The
// parts point into `data`.
std::vector<ClusterTrainer::StatePart> ClusterTrainer::all_processes_parts(const std::vector<StatePart>& mine,
                                                           std::vector<float>& data) const {
  const int R = mpi_->size();
  std::vector<int64_t> head;
  std::vector<float> payload;
  for (const StatePart& p : mine) {
    head.insert(head.end(), {p.t, p.start, p.n, p.tp_first, p.held_first});
    for (const float* src : {p.w, p.m1, p.m2}) payload.insert(payload.end(), src, src + p.n);
  }
  std::vector<int64_t> sizes(2 * R), counts = {(int64_t)head.size(), (int64_t)payload.size()};
  all_gather_equal(*mpi_, counts.data(), sizes.data(), 2 * sizeof(int64_t));
  std::vector<size_t> hb(R), db(R);
  size_t htotal = 0, dtotal = 0;
  for (int r = 0; r < R; ++r) {
    hb[r] = (size_t)sizes[2 * r] * sizeof(int64_t);
    db[r] = (size_t)sizes[2 * r + 1] * sizeof(float);
    htotal += sizes[2 * r];
    dtotal += sizes[2 * r + 1];
  }
  std::vector<int64_t> heads(htotal);
  data.resize(dtotal);
  mpi_->all_gather(head.data(), heads.data(), hb);
  mpi_->all_gather(payload.data(), data.data(), db);
  std::vector<StatePart> out;
  size_t at = 0;
  for (size_t h = 0; h + StatePart::kHeader <= heads.size(); h += StatePart::kHeader) {
    const int64_t n = heads[h + 2];
    out.push_back({heads[h], heads[h + 1], n, heads[h + 3], heads[h + 4], &data[at], &data[at + n], &data[at + 2 * n]});
    at += 3 * n;
  }
  return out;
}

// Assembles the global tensors from the ranks' pieces, as a checkpoint
// would, and hashes them canonically (contract rule 6).
std::string ClusterTrainer::state_hash() const {
  std::vector<float> data;  // under MPI, every process's pieces
  std::vector<StatePart> parts;
  if (!mpi_) {
    for (const auto& rank : ranks_)
      for (const StatePart& p : state_parts(*rank)) parts.push_back(p);
  } else {
    parts = all_processes_parts(state_parts(*ranks_[mpi_->rank()]), data);
  }
  return hash_pieces(all_tensors_, parts);
}

float* ClusterTrainer::storage(Rank& r, size_t t, const std::string& kind) const {
  const ParamInfo& p = r.model->params()[t];
  if (kind == "adam_m") return r.m.data() + r.shard_off[t];
  if (kind == "adam_v") return r.v.data() + r.shard_off[t];
  if (placement_.sharded(p)) return master_shard(r, t);
  return r.model->weights() + p.offset + range(r, t).first;
}

// What rank `rank` holds, as global ranges: its range of each tensor; of a
// tensor-parallel split tensor, whose held part is strided, the whole
// tensor (its expert-parallel slice), from which load_piece keeps the part.
std::vector<StatePiece> ClusterTrainer::state_needs(int rank) const {
  std::vector<StatePiece> out;
  const Rank& r = *ranks_[rank];
  const auto& infos = r.model->params();
  for (const char* kind : {"param/", "adam_m/", "adam_v/"})
    for (size_t t = 0; t < infos.size(); ++t) {
      const ParamInfo& p = infos[t];
      const auto [lo, hi] = range(r, t);
      if (hi <= lo) continue;
      const TensorSplit* split = p.feature_split();
      const int64_t end = split ? p.global_offset + p.size * split->parts : p.global_offset + hi;
      out.push_back({kind + p.name, p.global_shape, p.global_offset + lo, end, {}});
    }
  return out;
}

// Every global element is staged once. A tensor-parallel split tensor is
// staged in contiguous ranges, one of tp x (shard group size) near-equal
// ranges of the tensor (its expert-parallel slice) per writing rank: TP rank
// q, shard position g stages range q x G + g. With FSDP the shard group's
// shards of each TP part are gathered first; then each rank receives from
// its TP group just the elements of its range (gather_tp_range: each
// element travels once), not the assembled tensor.
void ClusterTrainer::stage_state(std::vector<std::vector<StatePiece>>& out) {
  out.resize(ranks_.size());
  for (size_t r = 0; r < ranks_.size(); ++r)
    if (!ranks_[r]) out[r].clear();  // another process's rank: it stages its own
  each_rank([&](RankCtx& c) {
    Rank& rank = c.rank;
    std::vector<StatePiece>& staged = out[(size_t)rank.index];
    const auto& infos = rank.model->params();
    size_t k = 0;  // pieces staged by this rank; buffers of an earlier save are reused in order
    ops::DeviceVector<float> held;
    TpRangeBuffers exchange;
    std::vector<float> range_held;  // a split tensor's range this rank stages
    for (const char* kind : {"param", "adam_m", "adam_v"})
      for (size_t t = 0; t < infos.size(); ++t) {
        const ParamInfo& p = infos[t];
        if (!placement_.writes_checkpoint(rank.index, t, p)) continue;
        const auto [lo, hi] = range(rank, t);
        const float* from = storage(rank, t, kind);
        StatePiece piece{std::string(kind) + "/" + p.name, p.global_shape, p.global_offset + lo, p.global_offset + hi, {}};
        if (p.feature_split()) {  // collectives: every writing rank of the groups takes part, whatever it holds
          const bool sharded = placement_.sharded(p);
          Communicator& tensor = c.group(p.feature_split()->axis);  // the group that splits it
          Communicator& shard = c.group(Axis::kShard);
          if (sharded) {
            held.resize(p.size);
            gather_shards(shard, p.size, from, held.data());
            from = held.data();
          }
          const int64_t per_part = sharded ? shard.size() : 1, ranges = (int64_t)tensor.size() * per_part;
          const int64_t total = p.size * tensor.size(), g = sharded ? shard.rank() : 0;
          auto range_of = [&](int q) {
            const int64_t k = (int64_t)q * per_part + g;
            return std::pair<int64_t, int64_t>{total * k / ranges, total * (k + 1) / ranges};
          };
          gather_tp_range(p, tensor, from, range_of, exchange, range_held);
          const auto [begin, end] = range_of(tensor.rank());
          from = range_held.data();
          piece.global_begin = p.global_offset + begin;
          piece.global_end = p.global_offset + end;
        }
        if (piece.global_end <= piece.global_begin) continue;
        if (k == staged.size()) staged.emplace_back();
        ops::StagingVector<float> buffer = std::move(staged[k].data);
        buffer.resize(piece.global_end - piece.global_begin);
        ops::copy_to_host(buffer.data(), from, buffer.size() * sizeof(float));
        staged[k] = std::move(piece);
        staged[k].data = std::move(buffer);
        ++k;
      }
    staged.resize(k);
  });
}

void ClusterTrainer::load_piece(int rank, const StatePiece& need, const float* data) {
  Rank& r = *ranks_[rank];
  const auto& infos = r.model->params();
  const size_t slash = need.name.find('/');
  const std::string kind = need.name.substr(0, slash), name = need.name.substr(slash + 1);
  size_t t = 0;
  while (infos[t].name != name) ++t;
  const ParamInfo& p = infos[t];
  float* to = storage(r, t, kind);
  if (r.node) r.node->stale = true;
  if (!p.feature_split()) {
    std::copy(data, data + (need.global_end - need.global_begin), to);
    return;
  }
  const auto [lo, hi] = range(r, t);  // the held part (an FSDP shard of it)
  for (int64_t i = lo; i < hi; ++i) to[i - lo] = data[p.global_index(i) - need.global_begin];
}

}  // namespace ls
