#include "runner/reference_trainer.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/error.h"
#include "contract.h"
#include "model/model.h"
#include "reference.h"
#include "runner/runner.h"

namespace ls {

ref::Config reference_config(const Scenario& s) {
  ref::Config c;
  const ModelConfig& m = s.model;
  c.vocab = m.vocab;
  c.d_model = m.d_model;
  c.n_layers = m.n_layers;
  c.n_heads = m.n_heads;
  c.seq_len = m.seq_len;
  c.d_ff = m.d_ff;
  c.experts = m.experts;
  c.top_k = m.top_k;
  c.shared_expert = m.shared_expert;
  c.init_std = m.init_std;
  c.rms_eps = m.rms_eps;
  c.aux_loss_weight = m.aux_loss_weight;
  c.z_loss_weight = m.z_loss_weight;
  c.router_skew = m.router_skew;
  c.aux_per_sample = m.aux_scope == AuxScope::kSequence;
  c.batch = s.batch;
  c.leaf_samples = s.leaf_samples;
  c.bf16 = s.precision == "bf16";
  const OptimConfig& o = s.optim;
  c.lr = o.lr;
  c.min_lr_ratio = o.min_lr_ratio;
  c.beta1 = o.beta1;
  c.beta2 = o.beta2;
  c.eps = o.eps;
  c.weight_decay = o.weight_decay;
  c.grad_clip = o.grad_clip;
  c.warmup_steps = o.warmup_steps;
  c.decay_steps = o.decay_steps > 0 ? o.decay_steps : s.steps;
  return c;
}

namespace {

class ReferenceTrainer : public Trainer {
 public:
  explicit ReferenceTrainer(const Scenario& s) : model_(reference_config(s), s.seed), model_cfg_(s.model) {}
  float train_step(const uint8_t* tokens, int batch, int step, float* grad_norm) override {
    ref::Losses<float> l = model_.forward_backward(tokens, batch);
    *grad_norm = model_.optimizer_step(step);
    return l.ce;
  }
  float eval_loss(const uint8_t* tokens, int batch) override { return model_.forward(tokens, batch).ce; }
  std::string state_hash() const override { return model_.state_hash(); }
  double train_flops_per_token() const override { return ls::train_flops_per_token(model_cfg_); }
  void set_trace(TraceSink* sink) override {
    if (!sink) {
      model_.trace = nullptr;
      return;
    }
    model_.trace = [sink](const char* phase, int layer, const char* op, const char* name, const float* data,
                          const std::vector<int64_t>& shape) { sink->tensor(phase, layer, op, name, data, shape); };
  }
  void debug_bump_weight(const std::string& param, int64_t index) override {
    ref::Param<float>* p = nullptr;
    for (auto& q : model_.params)
      if (q.name == param) p = &q;
    if (!p) throw UserError("--debug-bump: no parameter '" + param + "'");
    if (index < 0 || index >= p->size()) throw UserError("--debug-bump: index out of range for " + param);
    float& w = p->w[index];
    w = from_bits(bits(w) + (w >= 0 ? 1 : -1));
  }
  void set_debug_reorder_moe_norm(bool on) override {
    if (on) throw UserError("--debug-reorder: the reference has no debug reorderings (engine only)");
  }
  void stage_state(std::vector<std::vector<StatePiece>>&) override {
    throw UserError("ckpt: checkpoints are saved by the engine backend (the reference is the spec, not a trainer)");
  }
  // A restore delivers every tensor whole, as the engine's single rank needs it.
  std::vector<StatePiece> state_needs(int) const override {
    std::vector<StatePiece> out;
    for (const char* kind : {"param/", "adam_m/", "adam_v/"})
      for (const ref::Param<float>& p : model_.params) out.push_back({kind + p.name, p.shape, 0, p.size(), {}});
    return out;
  }
  void load_piece(int, const StatePiece& need, const float* data) override {
    const size_t slash = need.name.find('/');
    const std::string kind = need.name.substr(0, slash);
    ref::Param<float>& p = model_.param(need.name.substr(slash + 1));
    std::vector<float>& dst = kind == "param" ? p.w : kind == "adam_m" ? p.m : p.v;
    std::copy(data, data + (need.global_end - need.global_begin), dst.begin() + need.global_begin);
  }

 private:
  ref::Model<float> model_;
  ModelConfig model_cfg_;
};

}  // namespace

std::unique_ptr<Trainer> new_reference_trainer(const Scenario& s) { return std::make_unique<ReferenceTrainer>(s); }

}  // namespace ls
