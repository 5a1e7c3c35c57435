// Another backend's implementations of the engine's ops, installed for a run:
// the CUDA kernels (kernels/hook_table.inc), launched through the CPU
// emulation of CUDA (`cuda-emulated`) or on a GPU (`cuda`). A null entry
// keeps the engine's op. Installed with the numerics level for a run
// (ops/dispatch.h, where the ops look them up): with numerics.level=portable
// each hook gives the bits of the op it replaces; with numerics.level=local
// (the `cuda` backend only) the hooks are that level on the GPU (cuBLAS GEMMs).
#pragma once

#include <cstdint>

#include "ops/gemm.h"

namespace ls::ops {

struct OpHooks {
  void (*gemm)(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc, bool accumulate) = nullptr;
  void (*weight_grad)(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                      const int64_t* leaf_off, int64_t leaves, float* dW) = nullptr;
  // numerics.precision=bf16. gemm_bf16: the bits of ops::gemm_bf16_rounded
  // (fp32 operands rounded to bf16 as read; each output the ls::bf16_dot fold
  // over k from +0, or from C when accumulate). weight_grad_bf16: the leaf
  // tree of weight_grad, each leaf the ls::bf16_dot fold over its rows of the
  // rounded X[n][i] and dY[n][j] from +0 (an empty leaf +0); merges are fp32 adds.
  void (*gemm_bf16)(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc,
                    bool accumulate) = nullptr;
  void (*weight_grad_bf16)(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                           const int64_t* leaf_off, int64_t leaves, float* dW) = nullptr;
  void (*rmsnorm)(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps) = nullptr;
  void (*rmsnorm_backward)(const float* x, const float* w, const float* r, const float* dy, float* dh, int64_t N,
                           int D, bool accumulate) = nullptr;
  void (*rmsnorm_weight_grad)(const float* x, const float* r, const float* dy, int64_t N, int D, int64_t leaf_tokens,
                              float* dw) = nullptr;
  // Rows of n entries with equal strides in and out (the engine's other layouts keep its own op).
  void (*softmax_rows)(const float* z, float* p, int64_t ld, int rows, int n, float* lse) = nullptr;
  void (*softmax_backward_rows)(const float* p, const float* dp, float* dz, int64_t ld, int rows, int n) = nullptr;
  void (*swiglu)(const float* u, const float* v, float* s, float* act, int64_t n) = nullptr;
  void (*swiglu_backward)(const float* u, const float* v, const float* s, const float* dact, float* du, float* dv,
                          int64_t n) = nullptr;
  void (*swiglu_product)(const float* u, const float* s, const float* v, float* act, int64_t n) = nullptr;
  void (*add)(const float* a, const float* b, float* out, int64_t n) = nullptr;
  void (*fill)(float* p, int64_t n, float value) = nullptr;
  void (*copy_rows)(const float* src, const int64_t* src_row, float* dst, const int64_t* dst_row, int64_t n,
                    int64_t width) = nullptr;
  void (*slot_sum)(const float* rows, const int64_t* row_of, int K, int64_t N, int D, float* out) = nullptr;
  void (*add_row_vector)(float* x, int64_t N, int64_t ld, int cols, const float* vec) = nullptr;
  void (*z_loss_grad)(const float* g, const float* lse, int64_t N, int E, float two_zw, float Ng, float* dz) = nullptr;
  float (*param_sumsq)(const float* v, int64_t n) = nullptr;
  // Every head of a batch at once (ops::attention_forward_heads); bf16_probs: P rounded to bf16 (precision bf16).
  void (*attention_forward_heads)(const float* qkv, int B, int H, int S, int hd, float scale, float* P,
                                  float* o, bool bf16_probs) = nullptr;
  void (*attention_backward_heads)(const float* qkv, int B, int H, int S, int hd, float scale, const float* P,
                                   const float* dO, float* dqkv) = nullptr;
  // Context parallel: a query range of every head (ops::attention_forward_range_heads,
  // ops::attention_backward_range_heads).
  void (*attention_forward_range_heads)(const float* qkv, int B, int H, int S, int hd, float scale, int first,
                                        int count, float* P, int64_t probs_stride, int64_t p_off,
                                        float* o, bool bf16_probs) = nullptr;
  void (*attention_backward_range_heads)(const float* qkv, int b, int H, int S, int hd, float scale, int first,
                                         int count, const float* P, int64_t probs_stride, int64_t p_off,
                                         const float* dO, float* dqkv, bool continue_kv) = nullptr;
  void (*route_topk)(const float* g, int64_t N, int E, int K, int* sel) = nullptr;
  void (*moe_combine)(const float* g, int E, const int* sel, int K, const int64_t* row_of, const float* ye_rows,
                      const float* shared, const float* residual, float* hout, int64_t N, int D) = nullptr;
  void (*moe_combine_backward)(const float* dh, const float* g, int E, const int* sel, int K, const int64_t* row_of,
                               const float* ye_rows, float* dg, float* dye, int64_t N, int D) = nullptr;
  void (*embed)(const int* tok, const float* te, const float* pe, float* h, int64_t N, int S, int D) = nullptr;
  void (*embedding_grad)(const int* tok, const float* dh, int64_t N, int S, int D, int V, int64_t leaf_tokens,
                         int64_t leaves, float* gtok, float* gpos) = nullptr;
  void (*token_losses)(const float* lse, const float* logits, const int* target, int64_t N, int V, float* loss) = nullptr;
  void (*cross_entropy_grad)(const float* prob, const int* target, int64_t N, int V, float Ng, float* dlogits) = nullptr;
  float (*token_sum)(const float* v, int64_t N, int64_t leaf_tokens) = nullptr;
  void (*router_stats)(const float* g, const float* lse, int64_t N, int E, int64_t leaf_tokens, int64_t leaves,
                       float* sums) = nullptr;
  // Waits for every kernel launched so far (launches are asynchronous).
  void (*synchronize)() = nullptr;
  // One AdamW update of n elements (optim/adamw.cc's loop body, all its terms precomputed).
  void (*adamw)(float* w, float* g, float* m, float* v, int64_t n, bool decay, float beta1, float beta2,
                float one_minus_beta1, float one_minus_beta2, float bc1, float bc2, float eps, float weight_decay,
                float lr, bool clip, float clip_scale) = nullptr;
};

}  // namespace ls::ops
