#include "optim/adamw.h"
#include "ops/dispatch.h"
#include "common/op_profile.h"

#include <algorithm>

#include "common/parallel.h"
#include "contract.h"
#include "ops/ops.h"

namespace ls {

AdamW::AdamW(const OptimConfig& cfg, int total_steps, const std::vector<ParamInfo>& params)
    : cfg_(cfg), decay_steps_(ls::decay_steps(cfg, total_steps)), params_(params) {
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

int decay_steps(const OptimConfig& cfg, int total_steps) { return cfg.decay_steps > 0 ? cfg.decay_steps : total_steps; }

float global_norm_of(const std::vector<float>& sumsqs) {
  float total = 0.0f;  // reduces over tensors in canonical name order
  for (float s : sumsqs) total = total + s;
  return ls::sqrt(total);
}

void adamw_step(const OptimConfig& cfg, int decay_steps, int step, float norm, const std::vector<AdamWSlice>& slices) {
  const bool clip = cfg.grad_clip > 0 && norm > cfg.grad_clip;
  adamw_update(cfg, learning_rate(cfg, decay_steps, step), step, clip, clip ? cfg.grad_clip / norm : 1.0f, slices);
}

float AdamW::learning_rate(int step) const { return ls::learning_rate(cfg_, decay_steps_, step); }

void adamw_update(const OptimConfig& cfg, float lr, int step, bool clip, float clip_scale,
                  const std::vector<AdamWSlice>& slices) {
  const OpTimer op_timer(OpKind::kAdamw);
  const float b1 = cfg.beta1, b2 = cfg.beta2, omb1 = 1.0f - b1, omb2 = 1.0f - b2;
  float p1 = 1.0f, p2 = 1.0f;  // beta^t by repeated multiplication, t = step + 1
  for (int t = 0; t <= step; ++t) {
    p1 = p1 * b1;
    p2 = p2 * b2;
  }
  const float bc1 = 1.0f - p1, bc2 = 1.0f - p2, eps = cfg.eps, wd = cfg.weight_decay;
  // A kernel backend: one launch per slice (elementwise, so the same bits).
  if (auto k = ops::kernel(&ops::OpHooks::adamw)) {
    for (const AdamWSlice& sl : slices)
      if (sl.n > 0)
        k(sl.w, sl.g, sl.m, sl.v, sl.n, sl.decay, b1, b2, omb1, omb2, bc1, bc2, eps, wd, lr, clip, clip_scale);
    ops::synchronize();  // the host may read the state next (hashes, checkpoints)
    return;
  }
  // One loop over chunks of every slice, so that small tensors (norm gains,
  // the router) share jobs with the large ones instead of running alone.
  constexpr int64_t kChunk = 4096;
  std::vector<std::pair<int, int64_t>> chunks;  // (slice, first element)
  for (size_t s = 0; s < slices.size(); ++s)
    for (int64_t i = 0; i < slices[s].n; i += kChunk) chunks.push_back({(int)s, i});
  parallel_tasks((int64_t)chunks.size(), [&](int64_t c) {
    const AdamWSlice& s = slices[chunks[c].first];
    const int64_t lo = chunks[c].second, hi = std::min(s.n, lo + kChunk);
    // Locals: values read through the closure could alias the stores below,
    // which stops vectorization.
    float *pw = s.w, *pg = s.g, *pm = s.m, *pv = s.v;
    const bool decay = s.decay, clip_g = clip;
    const float B1 = b1, B2 = b2, OMB1 = omb1, OMB2 = omb2, BC1 = bc1, BC2 = bc2, EPS = eps, WD = wd, LR = lr,
                scale = clip_scale;
    for (int64_t i = lo; i < hi; ++i) {
      float gi = pg[i];
      if (clip_g) {
        gi = gi * scale;
        pg[i] = gi;
      }
      pm[i] = B1 * pm[i] + OMB1 * gi;
      pv[i] = B2 * pv[i] + OMB2 * (gi * gi);
      const float mhat = pm[i] / BC1, vhat = pv[i] / BC2;
      float upd = mhat / (ls::sqrt(vhat) + EPS);
      if (decay) upd = upd + WD * pw[i];
      pw[i] = pw[i] - LR * upd;
    }
  });
}

float AdamW::global_norm(const float* grads) const {
  std::vector<float> per(params_.size());
  parallel_tasks((int64_t)params_.size(),
                 [&](int64_t t) { per[t] = ops::param_sumsq(grads + params_[t].offset, params_[t].size); });
  return global_norm_of(per);
}

float AdamW::step(int step, float* w, float* g) {
  const float norm = global_norm(g);
  std::vector<AdamWSlice> slices;
  for (const ParamInfo& p : params_)
    slices.push_back({w + p.offset, g + p.offset, m_.data() + p.offset, v_.data() + p.offset, p.size, p.decay});
  adamw_step(cfg_, decay_steps_, step, norm, slices);
  return norm;
}

}  // namespace ls
