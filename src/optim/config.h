// AdamW and learning-rate schedule settings (scenario keys train.*).
#pragma once

namespace ls {

struct OptimConfig {
  float lr = 3e-3f;           // peak learning rate
  float min_lr_ratio = 0.1f;  // cosine decays to lr * min_lr_ratio
  int warmup_steps = 20;      // linear warmup from lr/warmup_steps to lr
  int decay_steps = 0;        // cosine length; 0 means train.steps
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // decoupled; applied to matrices, not norms
  float grad_clip = 1.0f;     // global L2 norm; 0 disables
};

}  // namespace ls
