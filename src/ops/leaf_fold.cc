#include "ops/leaf_fold.h"
#include "common/op_profile.h"

#include <algorithm>
#include <stdexcept>

#include "contract.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "common/precision.h"
#include "common/numerics_level.h"
#include "ops/local.h"
#include "ops/dispatch.h"
#include "ops/ops.h"

namespace ls {
namespace ops {

int64_t LeafFold::state_floats(int in, int out, int64_t leaves) {
  if (local_numerics()) return (int64_t)in * out;  // one accumulator: rows added in arrival (round) order
  return (int64_t)LeafTree::levels_for(leaves) * in * out;
}

void LeafFold::begin(int in, int out, int64_t leaves, DeviceVector<float>* state) {
  in_ = in;
  out_ = out;
  leaves_ = leaves;
  const int64_t n = state_floats(in, out, leaves);
  if ((int64_t)state->size() < n) state->resize(n);
  tree_ = LeafTree(state->data(), (int64_t)in * out);
  open_has_rows_ = false;
  pending_rows_ = 0;
  if (bf16_matmuls() && !local_numerics()) pending_.resize((size_t)(in + out) * kBf16FoldBlock);
}

void LeafFold::merge(int d) {
  float* left = tree_.slots + (int64_t)d * tree_.width;
  ops::add(left, left + tree_.width, left, tree_.width);
}

void LeafFold::fold_bf16(const float* X, int64_t ldx, const float* dY, int64_t ldy, int64_t rows) {
  weight_grad_bf16_fold(X, ldx, dY, ldy, in_, out_, rows, tree_.next_leaf(), open_has_rows_);
  open_has_rows_ = true;
}

void LeafFold::add_bf16_rows(const float* X, int64_t ldx, const float* dY, int64_t ldy, int64_t rows) {
  float* px = pending_.data();
  float* py = px + (int64_t)in_ * kBf16FoldBlock;
  if (pending_rows_ > 0) {  // complete the pending block first
    const int64_t take = std::min(rows, kBf16FoldBlock - pending_rows_);
    for (int64_t r = 0; r < take; ++r) {
      copy_rows(X + r * ldx, nullptr, px + (pending_rows_ + r) * in_, nullptr, 1, in_);
      copy_rows(dY + r * ldy, nullptr, py + (pending_rows_ + r) * out_, nullptr, 1, out_);
    }
    pending_rows_ += take;
    X += take * ldx, dY += take * ldy, rows -= take;
    if (pending_rows_ < kBf16FoldBlock) return;
    fold_bf16(px, in_, py, out_, kBf16FoldBlock);
    pending_rows_ = 0;
  }
  const int64_t whole = rows / kBf16FoldBlock * kBf16FoldBlock;
  if (whole > 0) fold_bf16(X, ldx, dY, ldy, whole);
  for (int64_t r = whole; r < rows; ++r, ++pending_rows_) {
    copy_rows(X + r * ldx, nullptr, px + pending_rows_ * in_, nullptr, 1, in_);
    copy_rows(dY + r * ldy, nullptr, py + pending_rows_ * out_, nullptr, 1, out_);
  }
}

void LeafFold::close_open_leaf() {
  if (pending_rows_ > 0) {  // the leaf's last block, padded with +0 by the fold
    fold_bf16(pending_.data(), in_, pending_.data() + (int64_t)in_ * kBf16FoldBlock, out_, pending_rows_);
    pending_rows_ = 0;
  }
  if (!open_has_rows_) fill(tree_.next_leaf(), tree_.width, 0.0f);  // an empty leaf is +0
  tree_.push_with([this](int d) { merge(d); });
  open_has_rows_ = false;  // the next leaf's first rows start its fold from +0 (no fill needed)
}

void LeafFold::add(const float* X, int64_t ldx, const float* dY, int64_t ldy, const int64_t* leaf, int64_t rows) {
  const OpTimer op_timer(OpKind::kWeightGrad);
  if (local_numerics()) {  // every row at once into one accumulator, whatever its leaf
    if (auto k = kernel(&OpHooks::gemm))  // the backend's local level: cuBLAS on the GPU
      k(in_, out_, rows, ConstMat{X, 1, ldx}, ConstMat{dY, ldy, 1}, tree_.slots, out_, open_has_rows_);
    else if (bf16_matmuls())  // the experts' weights: bf16 operands, oneDNN's matmul
      local::weight_grad_bf16(X, ldx, dY, ldy, in_, out_, rows, tree_.slots, open_has_rows_);
    else
      local::weight_grad(X, ldx, dY, ldy, in_, out_, rows, tree_.slots, open_has_rows_);
    open_has_rows_ = open_has_rows_ || rows > 0;
    return;
  }
  const bool bf16 = bf16_matmuls();
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t lf = leaf[r0];
    if (lf < tree_.pushed || lf >= leaves_) throw std::logic_error("LeafFold: leaf out of order");
    while (tree_.pushed < lf) close_open_leaf();
    int64_t r1 = r0 + 1;
    while (r1 < rows && leaf[r1] == lf) ++r1;
    if (bf16) {
      add_bf16_rows(X + r0 * ldx, ldx, dY + r0 * ldy, ldy, r1 - r0);
      r0 = r1;
      continue;
    }
    // A(i, k) = X[r0 + k][i]; B(k, j) = dY[r0 + k][j]; the fold starts from +0 (the leaf's first
    // rows) or continues from the open leaf.
    gemm(in_, out_, r1 - r0, ConstMat{X + r0 * ldx, 1, ldx}, ConstMat{dY + r0 * ldy, ldy, 1},
         tree_.next_leaf(), out_, open_has_rows_, 1);
    open_has_rows_ = true;
    r0 = r1;
  }
}

void LeafFold::finish(float* dW) {
  const OpTimer op_timer(OpKind::kWeightGrad);
  const int64_t w = tree_.width;
  if (local_numerics()) {
    if (!open_has_rows_) fill(tree_.slots, w, 0.0f);
    copy_rows(tree_.slots, nullptr, dW, nullptr, 1, w);
    return;
  }
  while (tree_.pushed < leaves_) close_open_leaf();
  if (tree_.depth == 0) fill(tree_.slots, w, 0.0f);  // no leaves: +0
  tree_.finish_with([this](int d) { merge(d); });
  copy_rows(tree_.slots, nullptr, dW, nullptr, 1, w);
}

}  // namespace ops
}  // namespace ls
