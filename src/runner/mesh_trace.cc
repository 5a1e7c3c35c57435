#include "runner/mesh_trace.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include "common/error.h"

namespace ls {
namespace {

// The one-rank order of a step's activation records (docs/TRACE.md): the
// forward's ops in each layer, then the head's; the backward's head ops, then
// each layer's.
const std::vector<std::string>& forward_ops() {
  static const std::vector<std::string> ops = {
      "attn_norm/out",  "qkv/out",         "attention/out", "attn_residual/h", "moe_norm/out",   "router/logits",
      "router/gates",   "moe.experts/out", "moe.combine/h", "final_norm/out",  "lm_head/logits", "loss/per_token"};
  return ops;
}
const std::vector<std::string>& backward_ops() {
  static const std::vector<std::string> ops = {"lm_head/dlogits", "final_norm/dh", "moe.experts/dx", "router/dz",
                                               "moe_norm/dh",     "attention/dqkv", "attn_norm/dh"};
  return ops;
}

int phase_order(const std::string& phase) {
  if (phase == "params") return 0;
  if (phase == "fwd") return 1;
  if (phase == "bwd") return 2;
  if (phase == "grad") return 3;
  throw InternalError("trace: no phase '" + phase + "'");
}

int64_t columns_of(const std::vector<int64_t>& shape) {
  int64_t c = 1;
  for (size_t d = 1; d < shape.size(); ++d) c *= shape[d];
  return c;
}

int64_t elements_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Calls fn(first logical element, its offset in the rank's buffer, packed
// index, count) for every span of a piece contiguous in all three, in
// packing order (a tensor of `cols` columns).
template <class Fn>
void for_each_span(const TracePiece& p, int64_t cols, Fn fn) {
  int64_t packed = 0;
  if (p.cols.empty()) {  // runs of flat elements
    for (const TraceRun& r : p.rows) fn(r.logical, r.local, packed, r.count), packed += r.count;
    return;
  }
  for (const TraceRun& r : p.rows)
    for (int64_t i = 0; i < r.count; ++i)
      for (const TraceRun& c : p.cols)
        fn((r.logical + i) * cols + c.logical, (r.local + i) * p.ld + c.local, packed, c.count), packed += c.count;
}

class RankSink : public TraceSink {
 public:
  RankSink(MeshTrace& trace, int rank) : trace_(trace), rank_(rank) {}
  void tensor(const char* phase, int layer, const char* op, const char* name, const float* data,
              const std::vector<int64_t>& shape, TraceDtype dtype = TraceDtype::kF32) override {
    TracePiece whole;
    whole.rows.push_back({0, 0, shape.empty() ? 1 : shape[0]});
    whole.cols.push_back({0, 0, columns_of(shape)});
    whole.ld = columns_of(shape);
    trace_.add(rank_, phase, layer, op, name, data, shape, whole, dtype);
  }
  void piece(const char* phase, int layer, const char* op, const char* name, const float* data,
             const std::vector<int64_t>& shape, const TracePiece& p, TraceDtype dtype = TraceDtype::kF32) override {
    trace_.add(rank_, phase, layer, op, name, data, shape, p, dtype);
  }

 private:
  MeshTrace& trace_;
  int rank_;
};

nlohmann::json runs_json(const std::vector<TraceRun>& runs) {
  nlohmann::json a = nlohmann::json::array();
  for (const TraceRun& r : runs) a.push_back({r.logical, r.count});
  return a;
}

}  // namespace

MeshTrace::MeshTrace(TraceSink* out, std::string ranks_path, int n_layers, std::vector<std::string> tensors,
                     std::vector<MeshConfig::RankCoords> coords)
    : out_(out), ranks_path_(std::move(ranks_path)), n_layers_(n_layers), coords_(std::move(coords)) {
  for (size_t t = 0; t < tensors.size(); ++t) tensor_index_[tensors[t]] = (int64_t)t;
  for (size_t r = 0; r < coords_.size(); ++r) sinks_.push_back(std::make_unique<RankSink>(*this, (int)r));
}

MeshTrace::~MeshTrace() = default;

TraceSink* MeshTrace::rank_sink(int rank) { return sinks_.at((size_t)rank).get(); }

void MeshTrace::add(int rank, const char* phase, int layer, const char* op, const char* name, const float* data,
                    const std::vector<int64_t>& shape, const TracePiece& where, TraceDtype dtype) {
  Piece p;
  p.rank = rank;
  p.where = where;
  for_each_span(where, columns_of(shape), [&](int64_t, int64_t local, int64_t, int64_t count) {
    p.data.insert(p.data.end(), data + local, data + local + count);
  });
  std::lock_guard<std::mutex> lock(mu_);
  Record& rec = records_[{phase, layer, op, name}];
  if (rec.pieces.empty()) {
    rec.phase = phase;
    rec.layer = layer;
    rec.op = op;
    rec.name = name;
    rec.shape = shape;
    rec.dtype = dtype;
    const auto t = tensor_index_.find(name);
    rec.seq = t == tensor_index_.end() ? 0 : t->second;
  } else if (rec.shape != shape) {
    throw InternalError(std::string("trace: ranks disagree on the shape of ") + phase + " " + op + "/" + name);
  } else if (rec.dtype != dtype) {
    throw InternalError(std::string("trace: ranks disagree on the dtype of ") + phase + " " + op + "/" + name);
  }
  rec.pieces.push_back(std::move(p));
}

MeshTrace::Key MeshTrace::order_of(const Record& r) const {
  const int phase = phase_order(r.phase);
  if (phase == 0 || phase == 3) return {phase, 0, 0, r.seq};
  const std::string op = r.op + "/" + r.name;
  const std::vector<std::string>& ops = phase == 1 ? forward_ops() : backward_ops();
  const auto at = std::find(ops.begin(), ops.end(), op);
  if (at == ops.end()) throw InternalError("trace: record " + r.phase + " " + op + " has no place in the one-rank order");
  // Forward: layers ascending, the head (-1) after them; backward: the head first, layers descending.
  const int64_t layer = phase == 1 ? (r.layer < 0 ? n_layers_ : r.layer) : (r.layer < 0 ? -1 : n_layers_ - r.layer);
  return {phase, layer, (int)(at - ops.begin()), 0};
}

namespace {

// A flat byte buffer of records, as processes exchange them.
struct Packer {
  std::vector<char> bytes;
  void i64(int64_t v) { raw(&v, sizeof v); }
  void str(const std::string& s) {
    i64((int64_t)s.size());
    raw(s.data(), s.size());
  }
  void raw(const void* p, size_t n) { bytes.insert(bytes.end(), (const char*)p, (const char*)p + n); }
};
struct Unpacker {
  const char* at;
  const char* end;
  int64_t i64() {
    int64_t v;
    raw(&v, sizeof v);
    return v;
  }
  std::string str() {
    std::string s((size_t)i64(), '\0');
    raw(s.data(), s.size());
    return s;
  }
  void raw(void* p, size_t n) {
    if ((size_t)(end - at) < n) throw InternalError("trace: a process's pieces arrived cut short");
    std::memcpy(p, at, n);
    at += n;
  }
};

void pack_runs(Packer& p, const std::vector<TraceRun>& runs) {
  p.i64((int64_t)runs.size());
  for (const TraceRun& r : runs) p.i64(r.logical), p.i64(r.local), p.i64(r.count);
}
std::vector<TraceRun> unpack_runs(Unpacker& u) {
  std::vector<TraceRun> runs((size_t)u.i64());
  for (TraceRun& r : runs) r.logical = u.i64(), r.local = u.i64(), r.count = u.i64();
  return runs;
}

}  // namespace

void MeshTrace::gather_to_first() {
  Packer p;
  p.i64((int64_t)records_.size());
  for (const auto& [k, r] : records_) {
    p.str(r.phase), p.i64(r.layer), p.str(r.op), p.str(r.name), p.i64(r.seq), p.i64((int64_t)r.dtype);
    p.i64((int64_t)r.shape.size());
    for (int64_t d : r.shape) p.i64(d);
    p.i64((int64_t)r.pieces.size());
    for (const Piece& x : r.pieces) {
      p.i64(x.rank);
      pack_runs(p, x.where.rows);
      pack_runs(p, x.where.cols);
      p.i64(x.where.ld);
      p.i64((int64_t)x.data.size());
      p.raw(x.data.data(), x.data.size() * sizeof(float));
    }
  }
  const int R = procs_->size();
  std::vector<int64_t> sizes((size_t)R);
  const int64_t mine = (int64_t)p.bytes.size();
  all_gather_equal(*procs_, &mine, sizes.data(), sizeof mine);
  std::vector<size_t> each((size_t)R);
  size_t total = 0;
  for (int r = 0; r < R; ++r) total += each[(size_t)r] = (size_t)sizes[(size_t)r];
  std::vector<char> all(total);
  procs_->all_gather(p.bytes.data(), all.data(), each);
  records_.clear();
  if (procs_->rank() != 0) return;  // process 0 writes
  Unpacker u{all.data(), all.data() + all.size()};
  for (int from = 0; from < R; ++from)
    for (int64_t n = u.i64(); n > 0; --n) {
      Record r;
      r.phase = u.str(), r.layer = (int)u.i64(), r.op = u.str(), r.name = u.str(), r.seq = u.i64();
      r.dtype = (TraceDtype)u.i64();
      r.shape.resize((size_t)u.i64());
      for (int64_t& d : r.shape) d = u.i64();
      r.pieces.resize((size_t)u.i64());
      for (Piece& x : r.pieces) {
        x.rank = (int)u.i64();
        x.where.rows = unpack_runs(u);
        x.where.cols = unpack_runs(u);
        x.where.ld = u.i64();
        x.data.resize((size_t)u.i64());
        u.raw(x.data.data(), x.data.size() * sizeof(float));
      }
      Record& into = records_[{r.phase, r.layer, r.op, r.name}];
      if (!into.pieces.empty() && into.dtype != r.dtype)
        throw InternalError("trace: processes disagree on the dtype of " + r.phase + " " + r.op + "/" + r.name);
      if (into.pieces.empty()) {
        std::vector<Piece> pieces = std::move(r.pieces);
        into = std::move(r);
        into.pieces = std::move(pieces);
      } else {
        for (Piece& x : r.pieces) into.pieces.push_back(std::move(x));
      }
    }
}

void MeshTrace::flush() {
  if (procs_ && procs_->size() > 1) {
    gather_to_first();
    if (procs_->rank() != 0) return;
  }
  std::vector<const Record*> in_order;
  for (const auto& [k, r] : records_) in_order.push_back(&r);
  std::sort(in_order.begin(), in_order.end(),
            [&](const Record* a, const Record* b) { return order_of(*a) < order_of(*b); });
  std::vector<float> whole;
  std::vector<unsigned char> held;
  for (const Record* r : in_order) {
    const int64_t n = elements_of(r->shape), cols = columns_of(r->shape);
    whole.assign((size_t)n, 0.0f);
    held.assign((size_t)n, 0);
    std::vector<const Piece*> pieces;
    for (const Piece& p : r->pieces) pieces.push_back(&p);
    // The lowest rank's bits where ranks overlap (replicas), whatever order the threads ran in.
    std::stable_sort(pieces.begin(), pieces.end(), [](const Piece* a, const Piece* b) { return a->rank < b->rank; });
    int64_t differ = 0;
    for (const Piece* p : pieces)
      for_each_span(p->where, cols, [&](int64_t e, int64_t, int64_t i, int64_t count) {
        if (e < 0 || e + count > n)
          throw InternalError("trace: rank " + std::to_string(p->rank) + "'s piece of " + r->phase + " " + r->op + "/" +
                              r->name + " reaches outside it");
        unsigned char* h = held.data() + e;
        if (std::find(h, h + count, 1) == h + count) {  // none held yet: the span whole
          std::memcpy(&whole[(size_t)e], &p->data[(size_t)i], sizeof(float) * (size_t)count);
          std::memset(h, 1, (size_t)count);
          return;
        }
        for (int64_t k = 0; k < count; ++k) {
          if (!h[k]) {
            h[k] = 1;
            whole[(size_t)(e + k)] = p->data[(size_t)(i + k)];
          } else if (std::memcmp(&whole[(size_t)(e + k)], &p->data[(size_t)(i + k)], sizeof(float)) != 0) {
            ++differ;
          }
        }
      });
    const auto missing = std::find(held.begin(), held.end(), 0);
    if (missing != held.end())
      throw InternalError("trace: no rank traced element " + std::to_string(missing - held.begin()) + " of " +
                          r->phase + " layer " + std::to_string(r->layer) + " " + r->op + "/" + r->name);
    if (differ > 0) {
      std::fprintf(stderr, "trace: %lld elements of %s layer %d %s/%s differ between the ranks that hold them "
                   "(the lowest rank's are written)\n", (long long)differ, r->phase.c_str(), r->layer, r->op.c_str(),
                   r->name.c_str());
    }
    out_->tensor(r->phase.c_str(), r->layer, r->op.c_str(), r->name.c_str(), whole.data(), r->shape, r->dtype);
  }
  if (!ranks_written_ && !ranks_path_.empty()) write_ranks_file(in_order);
  ranks_written_ = true;
  records_.clear();
}

// One line for the mesh, then one per record: every piece's rank and its
// rows and columns (runs of [first, count]; "elements" for flat runs).
void MeshTrace::write_ranks_file(const std::vector<const Record*>& in_order) {
  std::ofstream f(ranks_path_);
  if (!f) throw UserError("--trace: cannot write " + ranks_path_);
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < coords_.size(); ++r)
    ranks.push_back({{"rank", r},
                     {"stage", coords_[r].stage},
                     {"data", coords_[r].data},
                     {"context", coords_[r].context},
                     {"tensor", coords_[r].tensor}});
  f << nlohmann::json{{"kind", "ranks"}, {"format", "lockstep-trace-ranks-1"}, {"ranks", ranks}}.dump() << '\n';
  for (const Record* r : in_order) {
    nlohmann::json pieces = nlohmann::json::array();
    for (const Piece& p : r->pieces) {
      nlohmann::json j = {{"rank", p.rank}};
      if (p.where.cols.empty()) {
        j["elements"] = runs_json(p.where.rows);
      } else {
        j["rows"] = runs_json(p.where.rows);
        j["cols"] = runs_json(p.where.cols);
      }
      pieces.push_back(std::move(j));
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const nlohmann::json& a, const nlohmann::json& b) { return a["rank"] < b["rank"]; });
    f << nlohmann::json{{"kind", "record"}, {"phase", r->phase}, {"layer", r->layer}, {"op", r->op},
                        {"tensor", r->name}, {"shape", r->shape}, {"pieces", pieces}}
             .dump()
      << '\n';
  }
  if (!f) throw UserError("--trace: cannot write " + ranks_path_);
}

}  // namespace ls
