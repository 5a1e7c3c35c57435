#include "optim/adamw.h"

#include <algorithm>

#include "common/parallel.h"
#include "contract.h"
#include "ops/ops.h"

namespace ls {

AdamW::AdamW(const OptimConfig& cfg, int total_steps, const std::vector<ParamInfo>& params)
    : cfg_(cfg), decay_steps_(cfg.decay_steps > 0 ? cfg.decay_steps : total_steps), params_(params) {
  int64_t n = 0;
  for (const ParamInfo& p : params) n = std::max(n, p.offset + p.size);
  m_.assign(n, 0.0f);
  v_.assign(n, 0.0f);
}

float learning_rate(const OptimConfig& cfg, int decay_steps, int step) {
  if (step < cfg.warmup_steps) return cfg.lr * (float)(step + 1) / (float)cfg.warmup_steps;
  const int span = std::max(1, decay_steps - cfg.warmup_steps);
  float progress = (float)(step - cfg.warmup_steps) / (float)span;
  if (progress > 1.0f) progress = 1.0f;
  const float min_lr = cfg.lr * cfg.min_lr_ratio;
  const float coef = 0.5f * (1.0f + ls::ccos(3.14159265358979323846f * progress));
  return min_lr + (cfg.lr - min_lr) * coef;
}

float AdamW::learning_rate(int step) const { return ls::learning_rate(cfg_, decay_steps_, step); }

void adamw_update(const OptimConfig& cfg, float lr, int step, bool decay, float* pw, const float* pg, float* pm,
                  float* pv, int64_t n) {
  const float b1 = cfg.beta1, b2 = cfg.beta2, omb1 = 1.0f - b1, omb2 = 1.0f - b2;
  float p1 = 1.0f, p2 = 1.0f;  // beta^t by repeated multiplication, t = step + 1
  for (int t = 0; t <= step; ++t) {
    p1 = p1 * b1;
    p2 = p2 * b2;
  }
  const float bc1 = 1.0f - p1, bc2 = 1.0f - p2, eps = cfg.eps, wd = cfg.weight_decay;
  // By value: a float captured by reference could alias the stores, which stops vectorization.
  parallel_for(n, [=](int64_t i) {
    const float gi = pg[i];
    pm[i] = b1 * pm[i] + omb1 * gi;
    pv[i] = b2 * pv[i] + omb2 * (gi * gi);
    const float mhat = pm[i] / bc1, vhat = pv[i] / bc2;
    float upd = mhat / (ls::sqrt(vhat) + eps);
    if (decay) upd = upd + wd * pw[i];
    pw[i] = pw[i] - lr * upd;
  }, 16385);
}

float AdamW::global_norm(const float* grads) const {
  std::vector<float> per(params_.size());
  parallel_tasks((int64_t)params_.size(),
                 [&](int64_t t) { per[t] = ops::param_sumsq(grads + params_[t].offset, params_[t].size); });
  float total = 0.0f;  // reduces over tensors in canonical name order
  for (float s : per) total = total + s;
  return ls::sqrt(total);
}

float AdamW::step(int step, float* w, float* g) {
  const float norm = global_norm(g);
  const int64_t n = (int64_t)m_.size();
  if (cfg_.grad_clip > 0 && norm > cfg_.grad_clip) {
    const float scale = cfg_.grad_clip / norm;
    parallel_for(n, [&](int64_t i) { g[i] = g[i] * scale; });
  }
  const float lr = learning_rate(step);
  for (const ParamInfo& p : params_)
    adamw_update(cfg_, lr, step, p.decay, w + p.offset, g + p.offset, m_.data() + p.offset, v_.data() + p.offset,
                 p.size);
  return norm;
}

}  // namespace ls
