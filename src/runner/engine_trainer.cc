#include "runner/engine_trainer.h"

#include <omp.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "contract.h"
#include "model/model.h"
#include "ops/device_memory.h"
#include "optim/adamw.h"
#include "runner/data_lanes.h"

namespace ls {
namespace {

class EngineTrainer : public Trainer {
 public:
  explicit EngineTrainer(const Scenario& s)
      : model_(s.model, s.leaf_samples, s.seed), opt_(s.optim, s.steps, model_.params()),
        leaf_samples_(s.leaf_samples) {}
  float train_step(const uint8_t* tokens, int batch, int step, float* grad_norm) override {
    // With several threads, whole lanes of samples side by side when that
    // keeps the bits (runner/data_lanes.h); else every op split over threads.
    // Neither tracing nor a fault's phase hook picks the way (at
    // numerics.level=local the two ways give different bits): a traced step
    // in lanes writes the lanes' pieces as one rank's records, and the hook
    // fires in lane 0, the model it is set on.
    const int threads = omp_get_max_threads();
    StepLosses l;
    if (DataLanes::applicable(model_.config(), leaf_samples_, model_.num_weights(), batch, threads)) {
      if (!lanes_ || lanes_->lanes() != threads) lanes_ = std::make_unique<DataLanes>(model_, threads);
      model_.set_trace(nullptr);  // the lanes trace instead
      struct Retrace {
        MoeTransformer& model;
        TraceSink* sink;
        ~Retrace() { model.set_trace(sink); }
      } retrace{model_, trace_};
      l = lanes_->forward_backward(model_, tokens, batch, trace_);
    } else {
      l = model_.forward_backward(tokens, batch);
    }
    if (phase_hook_) phase_hook_(TrainPhase::kOptimizer, 0);
    *grad_norm = opt_.step(step, model_.weights(), model_.grads());
    return l.ce;
  }
  void set_phase_hook(std::function<void(TrainPhase, int)> hook) override {
    phase_hook_ = hook;
    if (hook) model_.set_phase_hook([hook](TrainPhase phase) { hook(phase, 0); });
    else model_.set_phase_hook(nullptr);
  }
  float eval_loss(const uint8_t* tokens, int batch) override { return model_.forward(tokens, batch).ce; }
  std::string state_hash() const override {
    StateHasher hs;  // names: adam_m/<p>, adam_v/<p>, param/<p> in bytewise order
    for (const char* kind : {"adam_m", "adam_v", "param"}) {
      const float* base = storage(kind);
      for (const ParamInfo& p : model_.params()) hs.add(kind + ("/" + p.name), p.shape, base + p.offset);
    }
    return hs.hex();
  }
  double train_flops_per_token() const override { return model_.train_flops_per_token(); }
  std::vector<int64_t> tokens_per_expert() const override { return model_.moe_stats().tokens_per_expert; }
  MeshReport mesh_report() const override {
    const MoeStats& st = model_.moe_stats();
    MeshReport m;
    m.add(st);
    return m;
  }
  void set_trace(TraceSink* sink) override {
    model_.set_trace(sink);
    trace_ = sink;
  }
  void debug_bump_weight(const std::string& param, int64_t index) override {
    bool known = false;
    for (const ParamInfo& q : model_.params()) known = known || q.name == param;
    if (!known) throw UserError("--debug-bump: no parameter '" + param + "'");
    const ParamInfo& p = model_.param(param);
    if (index < 0 || index >= p.size) throw UserError("--debug-bump: index out of range for " + param);
    float& w = model_.weights()[p.offset + index];
    w = from_bits(bits(w) + (w >= 0 ? 1 : -1));
  }
  void set_debug_reorder_moe_norm(bool on) override { model_.set_debug_reorder_moe_norm(on); }

  void stage_state(std::vector<std::vector<StatePiece>>& out) override {
    std::vector<StatePiece> needs = state_needs(0);
    out.resize(1);
    out[0].resize(needs.size());
    for (size_t i = 0; i < needs.size(); ++i) {
      ops::StagingVector<float> buffer = std::move(out[0][i].data);  // reused capacity
      out[0][i] = std::move(needs[i]);
      buffer.resize(out[0][i].global_end - out[0][i].global_begin);
      ops::copy_to_host(buffer.data(), source(out[0][i]), buffer.size() * sizeof(float));  // device -> staging
      out[0][i].data = std::move(buffer);
    }
  }
  std::vector<StatePiece> state_needs(int) const override {
    std::vector<StatePiece> out;
    for (const char* kind : {"param/", "adam_m/", "adam_v/"})
      for (const ParamInfo& p : model_.params()) out.push_back({kind + p.name, p.global_shape, 0, p.size, {}});
    return out;
  }
  void load_piece(int, const StatePiece& need, const float* data) override {
    float* dst = const_cast<float*>(source(need));
    std::copy(data, data + (need.global_end - need.global_begin), dst);
  }

 private:
  // The whole state of one kind, laid out as the weights: "param" (the
  // weights themselves), "adam_m" or "adam_v" (AdamW's moments).
  const float* storage(const std::string& kind) const {
    return kind == "param" ? model_.weights() : kind == "adam_m" ? opt_.m().data() : opt_.v().data();
  }
  // The storage of a whole-tensor piece named kind/param.
  const float* source(const StatePiece& p) const {
    const size_t slash = p.name.find('/');
    return storage(p.name.substr(0, slash)) + model_.param(p.name.substr(slash + 1)).offset;
  }
  MoeTransformer model_;
  AdamW opt_;
  int leaf_samples_;
  std::unique_ptr<DataLanes> lanes_;
  TraceSink* trace_ = nullptr;
  std::function<void(TrainPhase, int)> phase_hook_;
};

}  // namespace

std::unique_ptr<Trainer> new_engine_trainer(const Scenario& s) { return std::make_unique<EngineTrainer>(s); }

}  // namespace ls
