#include "emu/backend.h"

#include <omp.h>

#include <atomic>
#include <vector>

#include "common/parallel.h"
#include "emu/cuda_emu.h"
#include "attention.cuh"
#include "elementwise.cuh"
#include "embedding.cuh"
#include "gemm.cuh"
#include "loss.cuh"
#include "moe.cuh"
#include "rmsnorm.cuh"
#include "weight_grad.cuh"

namespace ls::emu {
namespace {

std::atomic<int64_t> g_launches{0};

// A launch: blocks in parallel unless the engine already runs this on one of
// its threads. Only the GEMM has barriers; the other kernels' threads run as
// plain calls (the emulator refuses a barrier there).
void launch(dim3 grid, dim3 block, const std::function<void()>& body, bool barriers = false) {
  g_launches.fetch_add(1, std::memory_order_relaxed);
  run_grid(grid, block, body, in_pool_job() || omp_in_parallel() ? 1 : 0, barriers);
}

unsigned blocks_for(int64_t n, unsigned per) { return (unsigned)((n + per - 1) / per); }

void gemm(int64_t M, int64_t N, int64_t K, ops::ConstMat A, ops::ConstMat B, float* C, int64_t ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  launch(kernels::contract_gemm_grid(M, N), kernels::contract_gemm_block(), [&] {
    kernels::contract_gemm(M, N, K, kernels::Mat{A.p, A.rs, A.cs}, kernels::Mat{B.p, B.rs, B.cs}, C, ldc, accumulate);
  }, /*barriers=*/true);
}

void weight_grad(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out, const int64_t* leaf_off,
                 int64_t leaves, float* dW) {
  launch(dim3(blocks_for(out, 16), blocks_for(in, 8)), dim3(16, 8), [&] {
    kernels::weight_grad_leaves(X, ldx, dY, ldy, in, out, leaf_off, leaves, dW);
  });
}

void rmsnorm(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps) {
  launch(dim3(blocks_for(N, 64)), dim3(64), [&] { kernels::rmsnorm_forward(x, w, y, r, N, D, eps); });
}

void rmsnorm_backward(const float* x, const float* w, const float* r, const float* dy, float* dh, int64_t N, int D,
                      bool accumulate) {
  launch(dim3(blocks_for(N, 64)), dim3(64), [&] { kernels::rmsnorm_backward(x, w, r, dy, dh, N, D, accumulate); });
}

void rmsnorm_weight_grad(const float* x, const float* r, const float* dy, int64_t N, int D, int64_t leaf_tokens,
                         float* dw) {
  launch(dim3(blocks_for(D, 32)), dim3(32), [&] { kernels::rmsnorm_weight_grad(x, r, dy, N, D, leaf_tokens, dw); });
}

void softmax_rows(const float* z, float* p, int64_t ld, int rows, int n, float* lse) {
  launch(dim3(blocks_for(rows, 64)), dim3(64), [&] { kernels::softmax_rows(z, p, ld, rows, n, lse); });
}

void softmax_backward_rows(const float* p, const float* dp, float* dz, int64_t ld, int rows, int n) {
  launch(dim3(blocks_for(rows, 64)), dim3(64), [&] { kernels::softmax_backward_rows(p, dp, dz, ld, rows, n); });
}

void swiglu(const float* u, const float* v, float* s, float* act, int64_t n) {
  launch(dim3(blocks_for(n, 256)), dim3(256), [&] { kernels::swiglu_forward(u, v, s, act, n); });
}

void swiglu_backward(const float* u, const float* v, const float* s, const float* dact, float* du, float* dv,
                     int64_t n) {
  launch(dim3(blocks_for(n, 256)), dim3(256), [&] { kernels::swiglu_backward(u, v, s, dact, du, dv, n); });
}

float param_sumsq(const float* v, int64_t n) {
  const int64_t blocks = (n + kParamBlock - 1) / kParamBlock;
  std::vector<float> sums((size_t)blocks);
  float out = 0.0f;
  launch(dim3(blocks_for(blocks, 32)), dim3(32), [&] { kernels::sumsq_blocks(v, n, sums.data()); });
  launch(dim3(1), dim3(1), [&] { kernels::tree_over_blocks(sums.data(), blocks, &out); });
  return out;
}

void attention_forward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                       float* P, float* o, int64_t ldo) {
  launch(dim3(blocks_for(S, 32)), dim3(32), [&] { kernels::attention_forward_rows(q, k, v, ld, S, hd, scale, P, o, ldo); });
}

void attention_backward(const float* q, const float* k, const float* v, int64_t ld, int S, int hd, float scale,
                        const float* P, const float* dO, int64_t ldo, float* dq, float* dk, float* dv, int64_t ldd) {
  thread_local std::vector<float> dS;
  dS.resize((size_t)kernels::attention_probs_floats(S));
  launch(dim3(blocks_for(S, 32)), dim3(32), [&] {
    kernels::attention_backward_rows(k, v, ld, S, hd, scale, P, dO, ldo, dS.data(), dq, ldd);
  });
  launch(dim3(blocks_for(S, 32)), dim3(32), [&] {
    kernels::attention_backward_cols(q, ld, S, hd, P, dS.data(), dO, ldo, dk, dv, ldd);
  });
}

void adamw(float* w, float* g, float* m, float* v, int64_t n, bool decay, float beta1, float beta2, float omb1,
           float omb2, float bc1, float bc2, float eps, float weight_decay, float lr, bool clip, float clip_scale) {
  const kernels::AdamWArgs a{beta1, beta2, omb1, omb2, bc1, bc2, eps, weight_decay, lr, clip_scale, clip, decay};
  launch(dim3(blocks_for(n, 256)), dim3(256), [&] { kernels::adamw_step(w, g, m, v, n, a); });
}

void route_topk(const float* g, int64_t N, int E, int K, int* sel) {
  launch(dim3(blocks_for(N, 64)), dim3(64), [&] { kernels::route_topk(g, N, E, K, sel); });
}

void moe_combine(const float* g, int E, const int* sel, int K, const int64_t* row_of, const float* ye_rows,
                 const float* shared, const float* residual, float* hout, int64_t N, int D) {
  launch(dim3(blocks_for(N, 64)), dim3(64), [&] {
    kernels::moe_combine(g, E, sel, K, row_of, ye_rows, shared, residual, hout, N, D);
  });
}

void moe_combine_backward(const float* dh, const float* g, int E, const int* sel, int K, const int64_t* row_of,
                          const float* ye_rows, float* dg, float* dye, int64_t N, int D) {
  launch(dim3(blocks_for(N * K, 64)), dim3(64), [&] {
    kernels::moe_combine_backward(dh, g, E, sel, K, row_of, ye_rows, dg, dye, N, D);
  });
}

void embed(const int* tok, const float* te, const float* pe, float* h, int64_t N, int S, int D) {
  launch(dim3(blocks_for(N, 64)), dim3(64), [&] { kernels::embed(tok, te, pe, h, N, S, D); });
}

void embedding_grad(const int* tok, const float* dh, int64_t N, int S, int D, int V, int64_t leaf_tokens,
                    int64_t leaves, float* gtok, float* gpos) {
  launch(dim3(blocks_for((int64_t)(V + S) * D, 128)), dim3(128), [&] {
    kernels::embedding_grad(tok, dh, N, S, D, V, leaf_tokens, leaves, gtok, gpos);
  });
}

void token_losses(const float* lse, const float* logits, const int* target, int64_t N, int V, float* loss) {
  launch(dim3(blocks_for(N, 64)), dim3(64), [&] { kernels::token_losses(lse, logits, target, N, V, loss); });
}

void cross_entropy_grad(const float* prob, const int* target, int64_t N, int V, float Ng, float* dlogits) {
  launch(dim3(blocks_for(N, 64)), dim3(64), [&] { kernels::cross_entropy_grad(prob, target, N, V, Ng, dlogits); });
}

float token_sum(const float* v, int64_t N, int64_t leaf_tokens) {
  const int64_t leaves = N / leaf_tokens;
  std::vector<float> part((size_t)leaves);
  float out = 0.0f;
  launch(dim3(blocks_for(leaves, 32)), dim3(32), [&] { kernels::leaf_sums(v, leaves, leaf_tokens, part.data()); });
  launch(dim3(1), dim3(1), [&] { kernels::tree_over_blocks(part.data(), leaves, &out); });
  return out;
}

void router_stats(const float* g, const float* lse, int64_t, int E, int64_t leaf_tokens, int64_t leaves, float* sums) {
  launch(dim3(blocks_for(E + 1, 32)), dim3(32), [&] { kernels::router_stats(g, lse, E, leaf_tokens, leaves, sums); });
}

void swiglu_product(const float* u, const float* s, const float* v, float* act, int64_t n) {
  launch(dim3(blocks_for(n, 256)), dim3(256), [&] { kernels::swiglu_product(u, s, v, act, n); });
}

void add(const float* a, const float* b, float* out, int64_t n) {
  launch(dim3(blocks_for(n, 256)), dim3(256), [&] { kernels::add(a, b, out, n); });
}

void fill(float* p, int64_t n, float value) {
  launch(dim3(blocks_for(n, 256)), dim3(256), [&] { kernels::fill(p, n, value); });
}

void copy_rows(const float* src, const int64_t* src_row, float* dst, const int64_t* dst_row, int64_t n,
               int64_t width) {
  if (n <= 0) return;
  launch(dim3(blocks_for(n * width, 256)), dim3(256), [&] { kernels::copy_rows(src, src_row, dst, dst_row, n, width); });
}

void slot_sum(const float* rows, const int64_t* row_of, int K, int64_t N, int D, float* out) {
  launch(dim3(blocks_for(N * D, 128)), dim3(128), [&] { kernels::slot_sum(rows, row_of, K, N, D, out); });
}

void add_row_vector(float* x, int64_t N, int64_t ld, int cols, const float* vec) {
  launch(dim3(blocks_for(N * cols, 128)), dim3(128), [&] { kernels::add_row_vector(x, N, ld, cols, vec); });
}

void z_loss_grad(const float* g, const float* lse, int64_t N, int E, float two_zw, float Ng, float* dz) {
  launch(dim3(blocks_for(N * E, 128)), dim3(128), [&] { kernels::z_loss_grad(g, lse, N, E, two_zw, Ng, dz); });
}

}  // namespace

const ops::OpHooks& kernel_hooks() {
  static const ops::OpHooks hooks = [] {
    ops::OpHooks h;
    h.gemm = gemm;
    h.weight_grad = weight_grad;
    h.rmsnorm = rmsnorm;
    h.rmsnorm_backward = rmsnorm_backward;
    h.rmsnorm_weight_grad = rmsnorm_weight_grad;
    h.softmax_rows = softmax_rows;
    h.softmax_backward_rows = softmax_backward_rows;
    h.swiglu = swiglu;
    h.swiglu_backward = swiglu_backward;
    h.param_sumsq = param_sumsq;
    h.attention_forward = attention_forward;
    h.attention_backward = attention_backward;
    h.adamw = adamw;
    h.route_topk = route_topk;
    h.moe_combine = moe_combine;
    h.moe_combine_backward = moe_combine_backward;
    h.embed = embed;
    h.embedding_grad = embedding_grad;
    h.token_losses = token_losses;
    h.cross_entropy_grad = cross_entropy_grad;
    h.token_sum = token_sum;
    h.router_stats = router_stats;
    h.swiglu_product = swiglu_product;
    h.add = add;
    h.fill = fill;
    h.copy_rows = copy_rows;
    h.slot_sum = slot_sum;
    h.add_row_vector = add_row_vector;
    h.z_loss_grad = z_loss_grad;
    return h;
  }();
  return hooks;
}

int64_t kernel_launches() { return g_launches.load(); }

}  // namespace ls::emu
