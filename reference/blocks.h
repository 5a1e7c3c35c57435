// The reference model's blocks, plain loops, paired one to one by name and
// order with the engine's (src/model/blocks.h):
//
//   embedding
//   per layer l:  layers.l.attention     RMSNorm, QKV, causal attention, output projection, residual
//                 layers.l.moe_routing   RMSNorm, router logits, softmax gates, top-k
//                 layers.l.moe_dispatch  each token's row copied to its K slots (backward: the slot sum)
//                 layers.l.moe_experts   each (token, slot) row through its expert's SwiGLU
//                 layers.l.moe_combine   shared expert, gated sum of the slots + residual, aux losses
//   head          final RMSNorm, output projection, cross-entropy
//
// The reference has no ranks: its dispatch keeps rows in (token, slot)
// order, where the engine groups them by expert and runs them in rounds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reference.h"

namespace ref {

// One step's activations and gradients, as the blocks hand them on.
template <class T>
struct Step {
  struct Layer {
    std::vector<T> x;                  // [N, D] the layer's input stream
    std::vector<T> a, r1, qkv, att, o;  // attention: normed input, 1/rms, QKV, probabilities, P V
    std::vector<T> xm;                 // [N, D] x + attention: the MoE block's input stream
    std::vector<T> a2, r2;             // MoE norm: output, 1/rms
    std::vector<T> z, g, lse;          // router logits, gates, log-sum-exp
    std::vector<int> sel;              // [N*K] expert of each (token, slot)
    std::vector<T> xe;                 // [N*K, D] each slot's input row (dispatch)
    std::vector<T> u, v, act, ye;      // [N*K, F] SwiGLU inputs and product; [N*K, D] expert outputs
    std::vector<T> shared_u, shared_v, shared_act, shared_out;  // the shared expert
    T aux = 0, zl = 0;                 // this layer's load-balancing and z losses
  };
  std::vector<int> tok_id, target_id;  // [N] each token's input byte and its target, the next byte
  int batch = 0;
  int64_t N = 0;                    // tokens
  bool training = false;
  std::vector<Layer> layers;
  std::vector<T> h;                 // [N, D] the stream after the last layer: the head's input
  std::vector<T> af, rf, logits, prob, loss;
  // Backward: dh is the gradient of the stream where the backward stands;
  // the MoE blocks of a layer hand on dg, dye, dxe and da2.
  std::vector<T> dh, dg, dye, dxe, da2, shared_dx;
};

// A block: its forward (adding to the step's loss sums) and backward over
// one step's state.
template <class T>
struct BlockDef {
  std::string name;
  int layer = -1;
  bool begins_at_stream = false;  // a range may begin here: only the residual stream comes in
  void (*forward)(Model<T>& m, Step<T>& st, int layer, Losses<T>& losses) = nullptr;
  void (*backward)(Model<T>& m, Step<T>& st, int layer) = nullptr;
};

// The blocks of a model of `c`, in forward order.
template <class T>
std::vector<BlockDef<T>> make_blocks(const Config& c);

// The stream entering block `b` (a begins_at_stream block, or the end).
template <class T>
std::vector<T>& stream_before(Step<T>& st, const BlockDef<T>& b);

}  // namespace ref
