// Tensor parallelism's one hard part: a fold over a feature index whose
// range is split between the ranks of the tensor-parallel group (a
// row-parallel GEMM such as the output projection or w2, or the input
// gradient of a column-parallel one such as QKV or w1/w3). The contract
// folds k sequentially from +0 (docs/NUMERICS.md §3); an all-reduce of
// partial folds would change the bits, so the fold is chained instead: the
// rank holding the first k-range folds first and hands its partial outputs
// to the rank holding the next range, which continues every output's fold
// (ops::gemm with accumulate), and so on; the last one broadcasts the
// finished outputs. Each link carries one output tensor.
#pragma once

#include <cstdint>
#include <functional>

#include "model/step_context.h"

namespace ls {

// Where a chained fold's outputs live. A contiguous output is handed over
// as is (pack/unpack empty); scattered rows (expert slots) are packed into
// `floats` contiguous floats and unpacked on the receiving rank.
struct ChainOutput {
  float* data = nullptr;  // contiguous outputs (or nullptr when packed)
  int64_t floats = 0;
  std::function<void(float*)> pack;          // outputs -> buffer
  std::function<void(const float*)> unpack;  // buffer -> outputs
};

// The fold's k-range, in the contract's order, is `passes` x tp segments,
// pass-major: segment p * tp + t belongs to TP rank t (passes > 1 where one
// fold crosses several split blocks, e.g. the q, k and v columns of QKV,
// or the hidden features of u and then of v). fold(first_pass, count,
// accumulate) continues (accumulate) or starts (+0) every output's fold over
// this rank's segments of passes first_pass .. first_pass + count - 1; on
// one rank all passes come in one call. On return every rank of the group
// holds the finished outputs. Reduces over the split feature index, in
// ascending order, whatever the group size.
void chained_fold(StepContext& ctx, int passes, const ChainOutput& out,
                  const std::function<void(int first_pass, int count, bool accumulate)>& fold);

}  // namespace ls
