// AVX-512 instantiation of the weight-gradient kernel (leaf_grad.h), built
// with AVX-512 flags and called only when the CPU has it.
#include <stdint.h>

#include "ops/leaf_grad.h"
#include "ops/vec_avx512.h"

namespace ls {
namespace ops {
namespace internal {

int64_t leaf_grad_scratch_floats_avx512(int64_t leaves, int64_t rows) {
  return leaf_grad::scratch_floats<Avx512, 8, 2>(leaves, rows);
}

void leaf_grad_column_tiles_avx512(const float* X, int64_t ldx, const float* dY, int64_t ldy,
                                   const int64_t* leaf_off, int64_t leaves, int i0, int i1, int j0, int j1, float* dW,
                                   int64_t ldw, float* scratch) {
  leaf_grad::column_tiles<Avx512, 8, 2>(X, ldx, dY, ldy, leaf_off, leaves, i0, i1, j0, j1, dW, ldw, scratch);
}

}  // namespace internal
}  // namespace ops
}  // namespace ls
