// The reference model: every equation as a plain loop, in the order the
// numerics contract fixes. Comments at each reduction name its index.
#include "reference.h"

#include "blocks.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "contract.h"

namespace ref {

std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes(const Config& c) {
  const int64_t V = c.vocab, D = c.d_model, F = c.d_ff, E = c.experts, T = c.seq_len;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  out.push_back({"tok_emb", {V, D}});
  out.push_back({"pos_emb", {T, D}});
  out.push_back({"final_norm", {D}});
  out.push_back({"lm_head", {D, V}});
  for (int l = 0; l < c.n_layers; ++l) {
    std::string p = "layers." + std::to_string(l) + ".";
    out.push_back({p + "attn_norm", {D}});
    out.push_back({p + "wqkv", {D, 3 * D}});
    out.push_back({p + "wo", {D, D}});
    out.push_back({p + "moe_norm", {D}});
    out.push_back({p + "router", {D, E}});
    out.push_back({p + "experts.w1", {E, D, F}});
    out.push_back({p + "experts.w3", {E, D, F}});
    out.push_back({p + "experts.w2", {E, F, D}});
    if (c.shared_expert) {
      out.push_back({p + "shared.w1", {D, F}});
      out.push_back({p + "shared.w3", {D, F}});
      out.push_back({p + "shared.w2", {F, D}});
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

template <class T>
Model<T>::Model(const Config& c, uint64_t seed) : cfg(c) {
  for (auto& [name, shape] : param_shapes(c)) {
    Param<T> p;
    p.name = name;
    p.shape = shape;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bool is_norm = shape.size() == 1;
    p.decay = !is_norm;
    p.w.resize(n);
    p.g.assign(n, T(0));
    p.m.assign(n, T(0));
    p.v.assign(n, T(0));
    const uint32_t id = ls::tensor_id(name.c_str());
    for (int64_t i = 0; i < n; ++i) p.w[i] = is_norm ? T(1) : T(ls::init_uniform(seed, id, (uint64_t)i, c.init_std));
    params.push_back(std::move(p));
  }
}

template <class T>
Param<T>& Model<T>::param(const std::string& name) {
  for (auto& p : params)
    if (p.name == name) return p;
  throw std::out_of_range("reference: no parameter '" + name + "'");
}

template <class T>
Losses<T> Model<T>::forward(const uint8_t* tokens, int batch) {
  return run(tokens, batch, false);
}
template <class T>
Losses<T> Model<T>::forward_backward(const uint8_t* tokens, int batch) {
  return run(tokens, batch, true);
}


template <class T>
std::vector<std::string> Model<T>::block_names() const {
  std::vector<std::string> names;
  for (const BlockDef<T>& b : make_blocks<T>(cfg)) names.push_back(b.name);
  return names;
}

template <class T>
void Model<T>::check_range(int first, int last) const {
  const std::vector<BlockDef<T>> blocks = make_blocks<T>(cfg);
  const int n = (int)blocks.size();
  if (first < 0 || last > n || first >= last)
    throw std::invalid_argument("reference: block range [" + std::to_string(first) + ", " + std::to_string(last) +
                                ") is not inside [0, " + std::to_string(n) + ")");
  for (int b : {first, last})
    if (b > 0 && b < n && !blocks[b].begins_at_stream)
      throw std::invalid_argument("reference: a block range cannot begin or end before " + blocks[b].name);
}

template <class T>
Losses<T> Model<T>::forward_range(const uint8_t* tokens, int batch, bool training, int first, int last,
                                  const T* stream_in, T* stream_out, Losses<T> carried) {
  check_range(first, last);
  const std::vector<BlockDef<T>> blocks = make_blocks<T>(cfg);
  step_ = std::make_shared<Step<T>>();
  Step<T>& st = *step_;
  st.batch = batch;
  st.N = (int64_t)batch * cfg.seq_len;
  const int S = cfg.seq_len;
  st.tok_id.resize(st.N);
  st.target_id.resize(st.N);
  for (int64_t n = 0; n < st.N; ++n) {
    st.tok_id[n] = (int)tokens[(n / S) * (S + 1) + n % S];
    st.target_id[n] = (int)tokens[(n / S) * (S + 1) + n % S + 1];
  }
  st.training = training;
  st.layers.resize(cfg.n_layers);
  const size_t stream = (size_t)st.N * cfg.d_model;
  if (first == 0 && training && trace)
    if constexpr (sizeof(T) == sizeof(float))
      for (auto& p : params) trace("params", -1, "param", p.name.c_str(), p.w.data(), p.shape);
  if (first > 0) stream_before(st, blocks[first]).assign(stream_in, stream_in + stream);
  for (int b = first; b < last; ++b) blocks[b].forward(*this, st, blocks[b].layer, carried);
  if (last < (int)blocks.size() && stream_out) {
    const std::vector<T>& out = stream_before(st, blocks[last]);
    std::copy(out.begin(), out.end(), stream_out);
  }
  return carried;
}

template <class T>
void Model<T>::backward_range(int first, int last, const T* grad_out, T* grad_in) {
  check_range(first, last);
  if (!step_) throw std::logic_error("reference: backward_range before a forward_range");
  const std::vector<BlockDef<T>> blocks = make_blocks<T>(cfg);
  Step<T>& st = *step_;
  const size_t stream = (size_t)st.N * cfg.d_model;
  if (last < (int)blocks.size()) st.dh.assign(grad_out, grad_out + stream);
  for (int b = last - 1; b >= first; --b) blocks[b].backward(*this, st, blocks[b].layer);
  if (first == 0 && st.training && trace)
    if constexpr (sizeof(T) == sizeof(float))
      for (auto& p : params) trace("grad", -1, "param", p.name.c_str(), p.g.data(), p.shape);
  if (first > 0 && grad_in) std::copy(st.dh.begin(), st.dh.end(), grad_in);
}

// A step: every block forward, then (training) every block backward.
template <class T>
Losses<T> Model<T>::run(const uint8_t* tokens, int batch, bool backward) {
  const int n = (int)block_names().size();
  const Losses<T> out = forward_range(tokens, batch, backward, 0, n, nullptr, nullptr, Losses<T>{});
  if (!backward) return out;
  for (auto& p : params) std::fill(p.g.begin(), p.g.end(), T(0));
  backward_range(0, n, nullptr, nullptr);
  return out;
}

template <class T>
T Model<T>::learning_rate(int step) const {
  const Config& c = cfg;
  if (step < c.warmup_steps) return T(c.lr) * T(step + 1) / T(c.warmup_steps);
  int span = std::max(1, c.decay_steps - c.warmup_steps);
  T progress = T(step - c.warmup_steps) / T(span);
  if (progress > T(1)) progress = T(1);
  T min_lr = T(c.lr) * T(c.min_lr_ratio);
  T coef = T(0.5f) * (T(1) + COS(T(3.14159265358979323846f) * progress));
  return min_lr + (T(c.lr) - min_lr) * coef;
}

template <class T>
T Model<T>::grad_norm() const {
  // Per tensor a parameter-index reduction (blocks of kParamBlock, canonical
  // tree), tensors summed in canonical name order.
  T total = 0;
  for (auto& p : params) {
    if constexpr (sizeof(T) == 4) {
      total = total + ls::param_sumsq(p.g.data(), p.size());
    } else {
      T s = 0;
      for (T x : p.g) s += x * x;
      total = total + s;
    }
  }
  return SQRT(total);
}

template <class T>
void Model<T>::adamw_step(int step, T norm) {
  const Config& c = cfg;
  // The one clipping rule, decided here as in the engine's adamw_step.
  const bool clip = c.grad_clip > 0 && norm > T(c.grad_clip);
  const T scale = clip ? T(c.grad_clip) / norm : T(1);
  const T lr = learning_rate(step);
  const T b1 = T(c.beta1), b2 = T(c.beta2), omb1 = T(1) - b1, omb2 = T(1) - b2;
  T p1 = 1, p2 = 1;  // beta^t by repeated multiplication, t = step + 1
  for (int t = 0; t <= step; ++t) {
    p1 = p1 * b1;
    p2 = p2 * b2;
  }
  const T bc1 = T(1) - p1, bc2 = T(1) - p2;
  for (auto& p : params)
    for (int64_t i = 0; i < p.size(); ++i) {
      if (clip) p.g[i] = p.g[i] * scale;
      T g = p.g[i];
      p.m[i] = b1 * p.m[i] + omb1 * g;
      p.v[i] = b2 * p.v[i] + omb2 * (g * g);
      T mhat = p.m[i] / bc1, vhat = p.v[i] / bc2;
      T upd = mhat / (SQRT(vhat) + T(c.eps));
      if (p.decay) upd = upd + T(c.weight_decay) * p.w[i];
      p.w[i] = p.w[i] - lr * upd;
    }
}

template <class T>
T Model<T>::optimizer_step(int step) {
  const T norm = grad_norm();
  adamw_step(step, norm);
  return norm;
}

template <class T>
std::string Model<T>::state_hash() const {
  if constexpr (sizeof(T) != sizeof(float)) {
    throw std::logic_error("reference: the state hash is defined for the float model only");
  } else {
    // Canonical names: adam_m/<p>, adam_v/<p>, param/<p>, in bytewise order.
    ls::StateHasher hs;
    for (const char* kind : {"adam_m/", "adam_v/", "param/"})
      for (auto& p : params) {
        const std::vector<float>& data = kind[0] == 'p' ? p.w : kind[5] == 'm' ? p.m : p.v;
        hs.add(kind + p.name, p.shape, data.data());
      }
    return hs.hex();
  }
}

template class Model<float>;
template class Model<double>;

}  // namespace ref
