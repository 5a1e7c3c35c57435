// The kernels of kernels/*.cuh under nvcc (-fmad=false): they must compile
// for the device as written; the emulated build (tests/test_kernels.cc)
// checks their bits on the CPU.
#include "attention.cuh"
#include "elementwise.cuh"
#include "embedding.cuh"
#include "gemm.cuh"
#include "loss.cuh"
#include "moe.cuh"
#include "rmsnorm.cuh"
#include "weight_grad.cuh"

// One launch of each, so that nvcc instantiates them for the device.
void lockstep_kernels_launch_check(const float* x, float* y, int64_t n) {
  using namespace ls::kernels;
  contract_gemm<<<contract_gemm_grid(n, n), contract_gemm_block()>>>(n, n, n, Mat{x, n, 1}, Mat{x, n, 1}, y, n, false);
  rmsnorm_forward<<<dim3((unsigned)((n + 127) / 128)), dim3(128)>>>(x, x, y, y, n, 1, 1e-5f);
  const int64_t* off = nullptr;
  weight_grad_leaves<<<dim3(1, 1), dim3(16, 16)>>>(x, n, x, n, 1, 1, off, 1, y);
  swiglu_forward<<<1, 128>>>(x, x, y, y, n);
  swiglu_backward<<<1, 128>>>(x, x, x, x, y, y, n);
  softmax_rows<<<1, 128>>>(x, y, n, 1, 1, y);
  sumsq_blocks<<<1, 128>>>(x, n, y);
  tree_over_blocks<<<1, 1>>>(x, 1, y);
  adamw_step<<<1, 128>>>(y, y, y, y, n, AdamWArgs{});
  rmsnorm_backward<<<1, 128>>>(x, x, x, x, y, n, 1, false);
  rmsnorm_weight_grad<<<1, 128>>>(x, x, x, n, 1, 1, y);
  attention_forward_rows<<<1, 64>>>(x, x, x, 1, 1, 1, 1.0f, y, y, 1);
  attention_backward_rows<<<1, 64>>>(x, x, 1, 1, 1, 1.0f, x, x, 1, y, y, 1);
  attention_backward_cols<<<1, 64>>>(x, 1, 1, 1, x, x, x, 1, y, y, 1);
  int* sel = nullptr;
  route_topk<<<1, 64>>>(x, n, 1, 1, sel);
  moe_combine<<<1, 64>>>(x, 1, sel, 1, off, x, nullptr, x, y, n, 1);
  moe_combine_backward<<<1, 64>>>(x, x, 1, sel, 1, off, x, y, y, n, 1);
  embed<<<1, 64>>>(sel, x, x, y, n, 1, 1);
  embedding_grad<<<1, 64>>>(sel, x, n, 1, 1, 1, 1, 1, y, y);
  token_losses<<<1, 64>>>(x, x, sel, n, 1, y);
  cross_entropy_grad<<<1, 64>>>(x, sel, n, 1, 1.0f, y);
  leaf_sums<<<1, 64>>>(x, n, 1, y);
  router_stats<<<1, 64>>>(x, x, 1, 1, 1, y);
}
