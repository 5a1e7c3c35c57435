// AdamW with decoupled weight decay, linear warmup then cosine decay, and
// global gradient-norm clipping, over the model's flat parameter arrays.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model.h"
#include "ops/device_memory.h"
#include "optim/config.h"

namespace ls {

// Learning rate at 0-based step: linear warmup, then cosine to lr * min_lr_ratio.
float learning_rate(const OptimConfig& cfg, int decay_steps, int step);
// The steps the cosine spans: cfg.decay_steps, or total_steps when it is 0.
int decay_steps(const OptimConfig& cfg, int total_steps);
// The global gradient norm from each tensor's sum of squares (by canonical
// index): the sums added in canonical order, then the square root. Reduces
// over the tensor index.
float global_norm_of(const std::vector<float>& sumsqs);

// n elements of a tensor (or of its shard) and their gradient and moments.
struct AdamWSlice {
  float *w, *g, *m, *v;
  int64_t n;
  bool decay;  // decoupled weight decay applies (matrices, not norm gains)
};

// The AdamW update at 0-based step of every slice, as one parallel loop
// (elementwise: any split of a tensor into shards gives the same bits). With
// clip, each gradient is first scaled, g = g * clip_scale, and stored back.
void adamw_update(const OptimConfig& cfg, float lr, int step, bool clip, float clip_scale,
                  const std::vector<AdamWSlice>& slices);
// One optimizer step given the pre-clip global norm: clipping by
// cfg.grad_clip (the engine's one place it is decided: grad_clip > 0 and
// norm > grad_clip scales every gradient by grad_clip / norm), the learning
// rate of the schedule, then adamw_update. Every engine trainer (one rank,
// data lanes, a mesh, the kernel backends) calls this; the reference states
// the same rule in its own ref::Model::adamw_step, sharing no code with it.
void adamw_step(const OptimConfig& cfg, int decay_steps, int step, float norm, const std::vector<AdamWSlice>& slices);

class AdamW {
 public:
  // total_steps sets the cosine length when cfg.decay_steps is 0.
  AdamW(const OptimConfig& cfg, int total_steps, const std::vector<ParamInfo>& params);

  // Learning rate at 0-based step.
  float learning_rate(int step) const;
  // Clips grads in place by the global norm, then updates weights and the
  // moments. Returns the pre-clip global gradient norm.
  float step(int step, float* weights, float* grads);

  // Global L2 norm of grads: per tensor a parameter-index reduction
  // (contract blocks + canonical tree), tensors added in canonical order.
  float global_norm(const float* grads) const;

  const ops::DeviceVector<float>& m() const { return m_; }
  const ops::DeviceVector<float>& v() const { return v_; }
  ops::DeviceVector<float>& m() { return m_; }
  ops::DeviceVector<float>& v() { return v_; }

 private:
  OptimConfig cfg_;
  int decay_steps_;
  std::vector<ParamInfo> params_;
  ops::DeviceVector<float> m_, v_;  // beside the weights, on the backend's memory
};

}  // namespace ls
