// The CPU reference: scalar, single-threaded loops that read like the
// equations. It is the spec the engine is held to, bit for bit, and shares
// only the numerics contract header with it. Instantiated for float (the
// contract) and double (finite-difference gradient checks, where the math
// functions come from libm and the fold order does not matter).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ref {

struct Config {
  int vocab = 256, d_model = 64, n_layers = 2, n_heads = 4, seq_len = 64, d_ff = 128;
  int experts = 8, top_k = 2;
  bool shared_expert = false;
  float init_std = 0.02f, rms_eps = 1e-5f, aux_loss_weight = 0.01f, z_loss_weight = 0.001f;
  float router_skew = 0.0f;  // added to the router logits of experts [0, max(1, E/4))
  bool aux_per_sample = false;  // the load-balancing loss per sample, averaged (moe.aux_scope=sequence)
  int batch = 16, leaf_samples = 1;
  // numerics.precision=bf16: the matrix products' operands rounded to bf16
  // (docs/NUMERICS.md section 10); the float model only.
  bool bf16 = false;
  // AdamW and schedule.
  float lr = 3e-3f, min_lr_ratio = 0.1f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0.1f, grad_clip = 1.0f;
  int warmup_steps = 20, decay_steps = 200;
};

template <class T>
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  bool decay = true;             // weight decay applies (matrices, not norms)
  std::vector<T> w, g, m, v;     // value, gradient, Adam moments
  int64_t size() const { return (int64_t)w.size(); }
};

// Loss terms of one forward pass.
template <class T>
struct Losses {
  T ce = 0;     // mean cross-entropy (nats per byte)
  T aux = 0;    // sum over layers of the Switch load-balancing loss
  T z = 0;      // sum over layers of the router z-loss
  T total = 0;  // ce + aux_w * aux + z_w * z: what the gradient is of
};

template <class T>
struct Step;  // one step's activations (blocks.h)

template <class T>
class Model {
 public:
  Model(const Config& c, uint64_t seed);  // contract init (Philox, purpose kInit)
  // tokens: batch * (seq_len + 1) bytes; sample b's inputs are bytes
  // [b*(T+1), b*(T+1)+T) and its targets the same shifted by one.
  Losses<T> forward(const uint8_t* tokens, int batch);
  // forward + backward; leaves gradients in Param::g (overwritten).
  Losses<T> forward_backward(const uint8_t* tokens, int batch);
  // The blocks (blocks.h), in forward order, named as the engine's.
  std::vector<std::string> block_names() const;
  // One step over blocks [first, last) only, as the engine's
  // MoeTransformer::forward_range: the forward takes the residual stream
  // entering block `first` (first > 0) and the loss sums so far, and writes
  // the stream entering block `last` (last < the block count); the
  // backward (after a training forward of the same range) takes that
  // stream's gradient and writes its input stream's. [N * d_model] each.
  Losses<T> forward_range(const uint8_t* tokens, int batch, bool training, int first, int last, const T* stream_in,
                          T* stream_out, Losses<T> carried);
  void backward_range(int first, int last, const T* grad_out, T* grad_in);
  // One optimizer step at 0-based `step`: grad_norm(), then adamw_step.
  // Returns the pre-clip norm.
  T optimizer_step(int step);
  // The global gradient norm of Param::g (pre-clip).
  T grad_norm() const;
  // AdamW at 0-based `step` given the pre-clip global norm; it decides
  // clipping (grad_clip > 0 and norm > grad_clip: each gradient scaled by
  // grad_clip / norm, and stored back) as the engine's ls::adamw_step does,
  // written here on its own.
  void adamw_step(int step, T norm);
  T learning_rate(int step) const;
  std::string state_hash() const;  // float only: contract state hash

  Config cfg;
  std::vector<Param<T>> params;  // sorted by name: the canonical order
  // Receives the tensors of forward_backward() (float model only), with the
  // engine's names and layouts: phase, layer (-1: none), op, tensor, data, shape.
  std::function<void(const char*, int, const char*, const char*, const float*, const std::vector<int64_t>&)> trace;
  Param<T>& param(const std::string& name);

 private:
  Losses<T> run(const uint8_t* tokens, int batch, bool backward);
  void check_range(int first, int last) const;
  std::shared_ptr<Step<T>> step_;  // the last forward's activations
};

extern template class Model<float>;
extern template class Model<double>;

// The canonical parameter names and shapes for a config (sorted).
std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes(const Config& c);

}  // namespace ref
