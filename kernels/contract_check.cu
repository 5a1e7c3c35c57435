#include "contract.h"
__global__ void k(float* x) { x[0] = ls::fma(x[1], x[2], x[3]); }
// Every contract math function must compile for the device.
__global__ void contract_math_check(const float* in, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = in[i];
  out[6 * i + 0] = ls::cexp(v);
  out[6 * i + 1] = ls::clog(v);
  out[6 * i + 2] = ls::ctanh(v);
  out[6 * i + 3] = ls::csigmoid(v);
  out[6 * i + 4] = ls::csin(v);
  out[6 * i + 5] = ls::ccos(v);
}
// The canonical leaf tree too (one thread: it is sequential by definition).
__global__ void leaf_tree_check(float* scratch, const float* leaves, int n, int width, float* out) {
  ls::LeafTree tree(scratch, width);
  for (int l = 0; l < n; ++l) {
    float* leaf = tree.next_leaf();
    for (int i = 0; i < width; ++i) leaf[i] = leaves[l * width + i];
    tree.push();
  }
  const float* sum = tree.finish();
  for (int i = 0; i < width; ++i) out[i] = sum[i];
}
// The bf16 fold (contract_bf16.h) too: the CUDA kernels of numerics.precision=bf16 will replay it.
__global__ void bf16_fold_check(const unsigned short* a, const unsigned short* b, int K, float* out) {
  out[0] = ls::bf16_dot(a, 1, b, 1, K, 0.0f);
  out[1] = ls::from_bf16(ls::to_bf16(out[0]));
}
