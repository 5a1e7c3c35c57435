// A weight gradient dW = X^T dY whose rows arrive in pieces: the MoE rounds
// hand an expert its tokens a capacity at a time, and a leaf of the
// reduction group may be split between two rounds or a borrowed slot. The
// fold keeps the canonical leaf tree's state (contract.h's LeafTree stack)
// and the open leaf's partial fma fold between calls, so the result has the
// bits of one ops::weight_grad over all the rows at once.
#pragma once

#include <stdint.h>

#include <vector>

#include "contract.h"
#include "ops/device_memory.h"

namespace ls {
namespace ops {

class LeafFold {
 public:
  // dW is in x out; the reduction group has `leaves` leaves. Storage:
  // (LeafTree::levels_for(leaves)) x in x out floats, taken from `state`
  // (kept by the caller so that it can be counted and reused).
  void begin(int in, int out, int64_t leaves, DeviceVector<float>* state);
  // Adds rows 0..rows-1 of X (ldx) and dY (ldy); row r belongs to leaf
  // leaf[r]. Leaves never decrease, within a call or from one call to the
  // next. Reduces over the token index: fma fold inside the leaf, in row
  // order, continuing the open leaf's fold from the last call. At bf16 the
  // leaf's fold is the bf16 fold (gemm_bf16.h, weight_grad_bf16), which
  // continues only after whole 32-row blocks: the open leaf's last rows
  // short of a block wait in `pending_` for the next call or the leaf's end.
  void add(const float* X, int64_t ldx, const float* dY, int64_t ldy, const int64_t* leaf, int64_t rows);
  // Closes the remaining leaves (empty ones are +0) and writes dW (in x out).
  void finish(float* dW);
  // Floats of state for the given shape.
  static int64_t state_floats(int in, int out, int64_t leaves);

 private:
  void close_open_leaf();
  // bf16: rows of the open leaf, through the pending block.
  void add_bf16_rows(const float* X, int64_t ldx, const float* dY, int64_t ldy, int64_t rows);
  void fold_bf16(const float* X, int64_t ldx, const float* dY, int64_t ldy, int64_t rows);
  // The stack merge left = left + right as ops::add (a kernel on a kernel backend).
  void merge(int d);
  int in_ = 0, out_ = 0;
  int64_t leaves_ = 0;
  // The canonical tree over the state: tree_.pushed is the open leaf (the
  // one being folded; leaves below it are on the stack), which lives in the
  // stack's next free entry, tree_.next_leaf().
  LeafTree tree_{nullptr, 0};
  bool open_has_rows_ = false;  // the open leaf's entry holds a fold (else it is not yet written)
  // bf16: the open leaf's rows past its last whole 32-row block (X rows in
  // wide, then dY rows out wide), pending_rows_ < 32 of them.
  DeviceVector<float> pending_;
  int64_t pending_rows_ = 0;
};

}  // namespace ops
}  // namespace ls
