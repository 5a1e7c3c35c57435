#include "runner/data_lanes.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include "cluster/communicator.h"
#include "common/error.h"
#include "common/thread_pool.h"
#include "runner/mesh_trace.h"

namespace ls {
namespace {

// Thrown in the lanes still waiting once another lane has failed.
struct LaneAborted : std::runtime_error {
  LaneAborted() : std::runtime_error("data lanes: another lane failed") {}
};

std::atomic<int>& lanes_switch() {
  static std::atomic<int> on{[] {
    const char* v = std::getenv("LOCKSTEP_DATA_LANES");
    return v && std::string(v) == "0" ? 0 : 1;
  }()};
  return on;
}

}  // namespace

bool data_lanes_enabled() { return lanes_switch().load() != 0; }
void set_data_lanes_enabled(bool on) { lanes_switch().store(on ? 1 : 0); }

// A lane's view of the others: the data group of its mesh, as a rank's is of
// the other data-parallel ranks. Lanes only sum; every other collective is
// a bug (no lane splits experts, features or positions).
class DataLanes::LaneGroup : public Communicator {
 public:
  LaneGroup(DataLanes& lanes, int lane) : lanes_(lanes), lane_(lane) {}
  int rank() const override { return lane_; }
  int size() const override { return lanes_.lanes_; }
  void barrier() override { lanes_.barrier(); }

  // Each lane's partial sums are a subtree of the leaf tree; the canonical
  // tree over lanes (in lane order, as over ranks) gives the whole tree. Every
  // lane computes it alike from the buffers the others posted.
  void all_reduce_sum(float* v, size_t n) override {
    lanes_.posted_[lane_] = v;
    lanes_.barrier();
    std::vector<const float*> parts(lanes_.lanes_);
    for (int r = 0; r < lanes_.lanes_; ++r) parts[r] = (const float*)lanes_.posted_[r];
    std::vector<float> out(n);
    tree_over_ranks(parts.data(), lanes_.lanes_, 0, n, out.data());
    lanes_.barrier();  // every lane has read every buffer
    std::copy(out.begin(), out.end(), v);
  }

  void all_reduce_sum(int64_t* v, size_t n) override {
    lanes_.posted_[lane_] = v;
    lanes_.barrier();
    std::vector<int64_t> out(n, 0);
    for (int r = 0; r < lanes_.lanes_; ++r)
      for (size_t i = 0; i < n; ++i) out[i] += ((const int64_t*)lanes_.posted_[r])[i];  // integers: any order
    lanes_.barrier();
    std::copy(out.begin(), out.end(), v);
  }

  void broadcast(void*, size_t, int, const char*) override { unsupported("broadcast"); }
  void reduce_scatter_sum(const float*, float*, const std::vector<size_t>&) override { unsupported("reduce_scatter"); }
  void all_gather(const void*, void*, const std::vector<size_t>&) override { unsupported("all_gather"); }
  void all_to_all(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&) override {
    unsupported("all_to_all");
  }
  void send(const void*, size_t, int, const char*) override { unsupported("send"); }
  void recv(void*, size_t, int, const char*) override { unsupported("recv"); }
  std::unique_ptr<Communicator> split(int, int) override { unsupported("split"); }

 private:
  [[noreturn]] static void unsupported(const char* what) {
    throw InternalError(std::string("data lanes: no ") + what + " between the lanes of one rank");
  }
  DataLanes& lanes_;
  int lane_;
};

DataLanes::DataLanes(const MoeTransformer& main, int lanes) : lanes_(lanes), posted_(lanes, nullptr) {
  for (int r = 1; r < lanes; ++r) models_.push_back(MoeTransformer::lane_of(main));
  for (int r = 0; r < lanes; ++r) {
    groups_.push_back(std::make_unique<LaneGroup>(*this, r));
    meshes_.push_back(std::make_unique<Mesh>());
    meshes_.back()->set_group(Axis::kData, groups_.back().get());
  }
}

DataLanes::~DataLanes() = default;

bool DataLanes::applicable(const ModelConfig& cfg, int leaf_samples, int64_t num_weights, int batch, int lanes) {
  if (!data_lanes_enabled() || lanes < 2 || leaf_samples < 1 || batch % lanes != 0) return false;
  const int per = batch / lanes;
  if (per % leaf_samples != 0) return false;
  const int leaves = per / leaf_samples;
  if (leaves & (leaves - 1)) return false;  // each lane's sums must be nodes of the tree
  if (cfg.moe_policy == MoePolicy::kDrop) return false;  // capacity counts one model's tokens
  // Each extra lane holds a gradient as large as the weights.
  return (int64_t)(lanes - 1) * num_weights * (int64_t)sizeof(float) <= (int64_t(512) << 20);
}

void DataLanes::barrier() {
  const uint64_t gen = barrier_gen_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == lanes_) {
    arrived_.store(0, std::memory_order_relaxed);
    barrier_gen_.store(gen + 1, std::memory_order_release);
    return;
  }
  for (int spins = 1; barrier_gen_.load(std::memory_order_acquire) == gen; ++spins) {
    if (failed_.load(std::memory_order_acquire)) throw LaneAborted();
    _mm_pause();
    if (spins % 4096 == 0) std::this_thread::yield();  // a lane's core may be busy elsewhere
  }
}

StepLosses DataLanes::forward_backward(MoeTransformer& main, const uint8_t* tokens, int batch, TraceSink* trace) {
  const int per = batch / lanes_;
  const int64_t sample_bytes = main.config().seq_len + 1, weights = main.num_weights();
  arrived_.store(0);
  failed_.store(false);
  error_ = nullptr;
  std::vector<MoeTransformer*> lane_models = {&main};
  for (auto& m : models_) {
    m->set_debug_reorder_moe_norm(main.debug_reorder_moe_norm());
    lane_models.push_back(m.get());
  }
  // Traced: each lane's pieces (a data-parallel rank's rows) assembled into
  // the one-rank records; the weights and the combined gradients are lane 0's.
  std::unique_ptr<MeshTrace> traced;
  if (trace) {
    std::vector<std::string> names;
    for (const ParamInfo& p : main.params()) names.push_back(p.name);
    traced = std::make_unique<MeshTrace>(trace, "", main.config().n_layers, std::move(names),
                                         std::vector<MeshConfig::RankCoords>((size_t)lanes_));
    for (int lane = 0; lane < lanes_; ++lane) lane_models[(size_t)lane]->set_trace(traced->rank_sink(lane), false);
    for (const ParamInfo& p : main.params())
      traced->rank_sink(0)->tensor("params", -1, "param", p.name.c_str(), main.weights() + p.offset, p.shape);
  }
  std::vector<const float*> grads;
  for (MoeTransformer* m : lane_models) grads.push_back(m->grads());
  StepLosses out;
  run_on_each_thread(lanes_, [&](int lane) {
    try {
      MoeTransformer& m = *lane_models[lane];
      m.set_mesh(meshes_[lane].get());
      const StepLosses l = m.forward_backward(tokens + (int64_t)lane * per * sample_bytes, per);
      if (lane == 0) out = l;  // the loss sums went through the tree: every lane holds the batch's
      barrier();               // every lane's gradient is complete
      // The canonical tree over lanes, element by element; each lane owns a
      // slice of the parameters and writes the result into lane 0's gradient.
      const int64_t lo = weights * lane / lanes_, hi = weights * (lane + 1) / lanes_;
      tree_over_ranks(grads.data(), lanes_, lo, hi - lo, main.grads() + lo);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu_);
      // The first real failure wins over the lanes it stopped.
      if (!error_ || !failed_.load()) error_ = std::current_exception();
      failed_.store(true, std::memory_order_release);
    }
  });
  for (MoeTransformer* m : lane_models) m->set_mesh(nullptr), m->set_trace(nullptr);
  if (error_) std::rethrow_exception(error_);
  if (traced) {
    for (const ParamInfo& p : main.params())
      traced->rank_sink(0)->tensor("grad", -1, "param", p.name.c_str(), main.grads() + p.offset, p.shape);
    traced->flush();
  }
  std::vector<const MoeStats*> stats;
  for (MoeTransformer* m : lane_models) stats.push_back(&m->moe_stats());
  main.set_moe_stats_from_lanes(stats);
  return out;
}

}  // namespace ls
