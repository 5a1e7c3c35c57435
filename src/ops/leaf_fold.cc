#include "ops/leaf_fold.h"
#include "common/op_profile.h"

#include <algorithm>
#include <stdexcept>

#include "contract.h"
#include "ops/gemm.h"
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
}

void LeafFold::merge(int d) {
  float* left = tree_.slots + (int64_t)d * tree_.width;
  ops::add(left, left + tree_.width, left, tree_.width);
}

void LeafFold::close_open_leaf() {
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
  if (bf16_matmuls() && rows > 0) {  // the same fold over the operands rounded to bf16 (ops.h, weight_grad)
    const RoundedRows r = round_rows_to_bf16(X, ldx, in_, dY, ldy, out_, rows);
    X = r.x, ldx = in_, dY = r.dy, ldy = out_;
  }
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t lf = leaf[r0];
    if (lf < tree_.pushed || lf >= leaves_) throw std::logic_error("LeafFold: leaf out of order");
    while (tree_.pushed < lf) close_open_leaf();
    int64_t r1 = r0 + 1;
    while (r1 < rows && leaf[r1] == lf) ++r1;
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
