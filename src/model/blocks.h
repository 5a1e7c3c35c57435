// The engine's model as a sequence of blocks. A training step runs every
// block's forward in order, then every block's backward in reverse; a
// pipeline stage runs a contiguous range of them (MoeTransformer::
// forward_range). Each block names the reference block (reference/blocks.h)
// it matches bit for bit.
//
//   embedding
//   per layer l:  layers.l.attention     RMSNorm, QKV, causal attention, output projection, residual
//                 layers.l.moe_routing   RMSNorm, router logits, softmax gates, top-k
//                 layers.l.moe_dispatch  rows grouped by expert, the expert-parallel round plans
//                 layers.l.moe_experts   the experts' rounds, with their exchanges
//                 layers.l.moe_combine   shared expert, gated sum of the slots + residual, aux losses
//   head          final RMSNorm, output projection, cross-entropy
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/step_context.h"

namespace ls {

class Block {
 public:
  virtual ~Block() = default;
  virtual std::string name() const = 0;
  // The forward pass; `losses` carries the step's loss sums from block to
  // block (aux and z folded layer by layer, ce and total at the head).
  virtual void forward(StepContext& ctx, StepLosses& losses) = 0;
  // The backward pass: ctx.ws.dh holds the gradient of this block's output
  // stream on entry and of its input stream on exit (the MoE blocks inside
  // a layer hand their gradients on through the layer's buffers instead).
  virtual void backward(StepContext& ctx) = 0;
  // Whether a range of blocks may begin here: the block's only input from
  // earlier blocks is the residual stream (the embedding reads the tokens;
  // the MoE blocks after the routing read its choices).
  virtual bool begins_at_stream() const { return false; }
  // That stream's buffer (only where begins_at_stream()).
  virtual float* stream_in(StepWorkspace&) const { return nullptr; }
};

// A block of one layer, named "layers.L.<kind>".
class LayerBlock : public Block {
 public:
  LayerBlock(int layer, const char* kind) : layer_(layer), kind_(kind) {}
  std::string name() const override { return "layers." + std::to_string(layer_) + "." + kind_; }

 protected:
  const int layer_;

 private:
  const char* kind_;
};

// The blocks of a model of `cfg`, in forward order.
std::vector<std::unique_ptr<Block>> make_blocks(const ModelConfig& cfg);

std::unique_ptr<Block> make_embedding_block();
std::unique_ptr<Block> make_attention_block(int layer);
std::unique_ptr<Block> make_moe_routing_block(int layer);
std::unique_ptr<Block> make_moe_dispatch_block(int layer);
std::unique_ptr<Block> make_moe_experts_block(int layer);
std::unique_ptr<Block> make_moe_combine_block(int layer);
std::unique_ptr<Block> make_head_block();

}  // namespace ls
