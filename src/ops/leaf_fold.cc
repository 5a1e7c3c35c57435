#include "ops/leaf_fold.h"
#include "common/op_profile.h"

#include <algorithm>
#include <stdexcept>

#include "contract.h"
#include "ops/gemm.h"
#include "common/numerics_level.h"
#include "ops/local.h"
#include "ops/hooks.h"
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
  open_ = 0;
  depth_ = 0;
  const int64_t n = state_floats(in, out, leaves);
  if ((int64_t)state->size() < n) state->resize(n);
  slots_ = state->data();
  open_has_rows_ = false;
}

// The open leaf lives in the stack's next free entry, as LeafTree::next_leaf
// would hand it out; pushing it merges equal-sized subtrees left + right, as
// LeafTree::push does, each merge an ops::add (a kernel on the CUDA backend).
void LeafFold::close_open_leaf() {
  const int64_t w = (int64_t)in_ * out_;
  if (!open_has_rows_) fill(slots_ + (int64_t)depth_ * w, w, 0.0f);  // an empty leaf is +0
  ++depth_;
  for (int m = LeafTree::merges_on_push(open_); m > 0; --m, --depth_) {
    float* left = slots_ + (int64_t)(depth_ - 2) * w;
    ops::add(left, slots_ + (int64_t)(depth_ - 1) * w, left, w);
  }
  ++open_;
  open_has_rows_ = false;  // the next leaf's first rows start its fold from +0 (no fill needed)
}

void LeafFold::add(const float* X, int64_t ldx, const float* dY, int64_t ldy, const int64_t* leaf, int64_t rows) {
  const OpTimer op_timer(OpKind::kWeightGrad);
  if (local_numerics()) {  // every row at once into one accumulator, whatever its leaf
    if (const OpHooks* h = op_hooks(); h && h->gemm)  // the backend's local level: cuBLAS on the GPU
      h->gemm(in_, out_, rows, ConstMat{X, 1, ldx}, ConstMat{dY, ldy, 1}, slots_, out_, open_has_rows_);
    else
      local::weight_grad(X, ldx, dY, ldy, in_, out_, rows, slots_, open_has_rows_);
    open_has_rows_ = open_has_rows_ || rows > 0;
    return;
  }
  const int64_t w = (int64_t)in_ * out_;
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t lf = leaf[r0];
    if (lf < open_ || lf >= leaves_) throw std::logic_error("LeafFold: leaf out of order");
    while (open_ < lf) close_open_leaf();
    int64_t r1 = r0 + 1;
    while (r1 < rows && leaf[r1] == lf) ++r1;
    // A(i, k) = X[r0 + k][i]; B(k, j) = dY[r0 + k][j]; the fold starts from +0 (the leaf's first
    // rows) or continues from the open leaf.
    gemm(in_, out_, r1 - r0, ConstMat{X + r0 * ldx, 1, ldx}, ConstMat{dY + r0 * ldy, ldy, 1},
         slots_ + (int64_t)depth_ * w, out_, open_has_rows_, 1);
    open_has_rows_ = true;
    r0 = r1;
  }
}

void LeafFold::finish(float* dW) {
  const OpTimer op_timer(OpKind::kWeightGrad);
  const int64_t w = (int64_t)in_ * out_;
  if (local_numerics()) {
    if (!open_has_rows_) fill(slots_, w, 0.0f);
    copy_rows(slots_, nullptr, dW, nullptr, 1, w);
    return;
  }
  while (open_ < leaves_) close_open_leaf();
  // LeafTree::finish: the stack folded right to left into its first entry.
  if (depth_ == 0) fill(slots_, w, 0.0f);
  for (int d = depth_ - 1; d >= 1; --d) {
    float* left = slots_ + (int64_t)(d - 1) * w;
    ops::add(left, slots_ + (int64_t)d * w, left, w);
  }
  copy_rows(slots_, nullptr, dW, nullptr, 1, w);
}

}  // namespace ops
}  // namespace ls
