// Engine ops with their backward passes, each the fast twin of a loop in
// reference/reference.cc with the same bits. Tokens are rows; every op names
// the logical index it reduces over. Token reductions take leaf offsets:
// leaf l covers rows [leaf_off[l], leaf_off[l+1]) (empty leaves are +0).
#pragma once

#include <cstdint>

#include "ops/gemm.h"

namespace ls::ops {

// The precision a matrix product's operands take: the run's
// (numerics.precision), or fp32 at every precision (the router's products:
// docs/NUMERICS.md §10).
enum class Operands { kRun, kFp32 };

// C (+)= A·B for a product that reduces over a feature index k (a layer's
// forward or input gradient): the contract GEMM (ops/gemm.h) at
// numerics.precision=fp32; at bf16 the bf16 fold over A and B rounded to
// bf16 (gemm_bf16_rounded, ops/gemm_bf16.h). Reduces over k.
void matmul(int64_t M, int64_t N, int64_t K, ConstMat A, ConstMat B, float* C, int64_t ldc, bool accumulate,
            int threads = 0, Operands operands = Operands::kRun);

// Y[n][j] = sum_i X[n][i] W[i][j]; W is [in, out]. Reduces over the input feature i.
void linear(const float* X, int64_t N, int in, const float* W, int out, float* Y,
            Operands operands = Operands::kRun);

// dX[n][i] (+)= sum_j dY[n][j] W[i][j]. Reduces over the output feature j; with
// accumulate the fold continues from dX's current value.
void linear_input_grad(const float* dY, int64_t N, int out, const float* W, int in, float* dX,
                       bool accumulate, Operands operands = Operands::kRun);

// Both on strided operands (a block of a wider X, dY or W, e.g. the columns
// or rows a tensor-parallel rank holds), writing Y or dX (ldy / ldx wide)
// or, with accumulate, continuing each output's fold from its current value.
// Y[n][j] (+)= sum_i X[n][i] W[i][j]: reduces over the input feature i.
void linear_strided(const float* X, int64_t ldx, int64_t N, int in, const float* W, int64_t ldw, int out, float* Y,
                    int64_t ldy, bool accumulate);
// dX[n][i] (+)= sum_j dY[n][j] W[i][j]: reduces over the output feature j.
void linear_input_grad_strided(const float* dY, int64_t lddy, int64_t N, int out, const float* W, int64_t ldw, int in,
                               float* dX, int64_t lddx, bool accumulate);

// dW[i][j] = sum_n X[n][i] dY[n][j]. Reduces over the global token index n:
// fma fold inside each leaf, the canonical tree over leaves. At bf16 (unless
// Operands::kFp32, the router's) the leaf's fold is the bf16 fold over X and
// dY rounded to bf16, its 32-row blocks starting at the leaf's first row
// (weight_grad_bf16, ops/gemm_bf16.h).
void weight_grad(const float* X, int64_t ldx, const float* dY, int64_t ldy, int in, int out,
                 const int64_t* leaf_off, int64_t leaves, float* dW, Operands operands = Operands::kRun);

// y = (x * r) * w with r = 1/sqrt(sum_i x_i^2 / D + eps). Reduces over the feature i.
void rmsnorm(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps);
// Debug only: rmsnorm with the sum of squares folded in descending feature
// order, violating the contract on purpose (drift-tool tests find it).
void rmsnorm_debug_reversed(const float* x, const float* w, float* y, float* r, int64_t N, int D, float eps);
// dx = r * (dxhat - xhat * (dxhat . xhat) / D), dxhat = dy * w; written to dh,
// or added to it (dh = dh + dx) with accumulate. Reduces over the feature i.
void rmsnorm_backward(const float* x, const float* w, const float* r, const float* dy, float* dh,
                      int64_t N, int D, bool accumulate);
// dw_i = sum_n dy[n][i] * (x[n][i] * r[n]). Reduces over the token index n (leaves).
void rmsnorm_weight_grad(const float* x, const float* r, const float* dy, int64_t N, int D,
                         int64_t leaf_tokens, float* dw);

// p = softmax(z) over n entries (max-shifted, sequential sum); returns
// log-sum-exp. Reduces over the entry index.
float softmax(const float* z, float* p, int n);
// dz_e = p_e * (dp_e - sum_e' dp_e' p_e'). Reduces over the entry index.
void softmax_backward(const float* p, const float* dp, float* dz, int n);

// out[r] = fold over i = 0..n-1, ascending, from +0, of fma(a[r][i], b[r][i], .)
// for eight rows r: eight dot products side by side, each in its own vector
// lane. Reduces over the feature i.
void dots8(const float* const a[8], const float* const b[8], int n, float out[8]);
// out[r] = fold over i = 0..n-1, ascending, from +0, of out + a[r][i], for
// eight rows side by side. Reduces over the entry index i.
void sums8(const float* const a[8], int n, float out[8]);

// softmax() over `rows` rows, bit for bit, with the sequential sums of eight
// rows run side by side (independent chains). Row r has n0 + r * step entries
// (step >= 0) at z + r*ldz -> p + r*ldp; lse[r] gets softmax()'s return value
// (lse may be null).
void softmax_rows(const float* z, int64_t ldz, float* p, int64_t ldp, int rows, int n0, int step, float* lse);

// softmax_backward() over rows laid out as in softmax_rows, bit for bit, with
// the dot products of eight rows side by side.
void softmax_backward_rows(const float* p, int64_t ldp, const float* dp, int64_t lddp, float* dz, int64_t lddz,
                           int rows, int n0, int step);

// Sum over tokens of per-token scalars v[n]: sequential add inside each leaf
// of leaf_tokens tokens, canonical tree over leaves.
float token_sum(const float* v, int64_t N, int64_t leaf_tokens);

// Engine twin of ls::param_sumsq, same bits: reduces over the parameter index,
// an fma fold inside each kParamBlock block, blocks by the canonical tree.
// Eight blocks fold side by side (independent chains instead of one).
float param_sumsq(const float* v, int64_t n);
// sums[b] = the fma fold of block b of kParamBlock parameters (the last may
// be shorter), b < ceil(n / kParamBlock): param_sumsq's leaves, for a caller
// that holds some blocks and trees them with the others'. Reduces over the
// parameter index inside a block.
void param_block_sumsqs(const float* v, int64_t n, float* sums);
// acc[i] = acc[i] continued by the fma fold of piece i, v[i * len, (i + 1) * len):
// a block's fold carried on across pieces held in different places, bit for
// bit the fold over the block. Reduces over the parameter index inside a piece.
void param_piece_sumsqs(const float* v, int64_t pieces, int64_t len, float* acc);

// SwiGLU hidden of n elements: s = sigmoid(u) (kept for the backward),
// act = (u * s) * v. Elementwise.
void swiglu(const float* u, const float* v, float* s, float* act, int64_t n);
// From dact: dv = dact * (u * s), du = (dact * v) * (s * (1 + u * (1 - s))).
// act = (u * s) * v from a kept gate s: the product swiglu writes, bit for bit.
void swiglu_product(const float* u, const float* s, const float* v, float* act, int64_t n);
void swiglu_backward(const float* u, const float* v, const float* s, const float* dact, float* du, float* dv,
                     int64_t n);

// MoE routing: sel[n*K + s] = the s-th largest gate of token n among the
// experts not yet taken, ties to the lowest index (E <= 256). Reduces over
// the expert index: an argmax scan in ascending e, K times.
void route_topk(const float* g, int64_t N, int E, int K, int* sel);

// MoE combine: hout[n] = residual[n] + (fold over slots s of fma(gate, y_s, .)
// from +0, then + shared[n] when shared is not null), gate = g[n][sel], y_s
// = ye_rows[row_of[n*K + s]]. Reduces over the slot s.
void moe_combine(const float* g, int E, const int* sel, int K, const int64_t* row_of, const float* ye_rows,
                 const float* shared, const float* residual, float* hout, int64_t N, int D);

// Its backward for every (token, slot) pair q = n*K + s: dg[n][sel] = fold
// over the feature j of fma(dh[n][j], y_q[j], .) from +0, and the expert
// row's gradient dye[row_of[q]] = gate * dh[n]. Reduces over the feature j.
void moe_combine_backward(const float* dh, const float* g, int E, const int* sel, int K, const int64_t* row_of,
                          const float* ye_rows, float* dg, float* dye, int64_t N, int D);

// Embedding: h[n] = te[tok[n]] + pe[n % S]. Elementwise.
void embed(const int* tok, const float* te, const float* pe, float* h, int64_t N, int S, int D);

// The embedding gradients, a scatter-add by token id as a reduction over the
// token index: gtok[v][i] = canonical tree over leaves (leaf_tokens tokens
// each, whole samples) of (the leaf's tokens n with tok[n] = v, ascending, added
// from +0; an absent byte gives +0); gpos[p][i] the same over the tokens at
// position p. Reduces over the token index n.
void embedding_grad(const int* tok, const float* dh, int64_t N, int S, int D, int V, int64_t leaf_tokens,
                    int64_t leaves, float* gtok, float* gpos);

// Router statistics for the aux and z losses: sums[e] = canonical tree over
// leaves of (the leaf's gates g[n][e] added in token order from +0), for
// e < E; sums[E] the same of fma(lse[n], lse[n], .). Reduces over the token index.
void router_stats(const float* g, const float* lse, int64_t N, int E, int64_t leaf_tokens, int64_t leaves, float* sums);

// Cross-entropy per token: loss[n] = lse[n] - logits[n][target[n]]. Elementwise.
void token_losses(const float* lse, const float* logits, const int* target, int64_t N, int V, float* loss);
// Its gradient: dlogits[n][v] = (p[n][v] - [v = target[n]]) / Ng, the global
// token count. Elementwise.
void cross_entropy_grad(const float* prob, const int* target, int64_t N, int V, float Ng, float* dlogits);

// Kernel backends launch asynchronously, in order: this waits until every
// kernel launched so far has finished, after which the host may read and
// write what they used. The model calls it before each host access to a
// buffer kernels touch. No-op on the engine.
void synchronize();

// ---- Data movement and elementwise steps between the ops above (each a
// kernel of its own on the CUDA backend, so that no tensor leaves the device).

// out = a + b, elementwise (out may be a or b). Elementwise.
void add(const float* a, const float* b, float* out, int64_t n);
// p[i] = value. Elementwise.
void fill(float* p, int64_t n, float value);
// For t < n: row dst_row[t] of dst = row src_row[t] of src, rows of `width`
// floats; a null index list is the identity (row t). Rows written must not
// overlap rows read. No reduction.
void copy_rows(const float* src, const int64_t* src_row, float* dst, const int64_t* dst_row, int64_t n,
               int64_t width);
// out[n] = fold over slots s = 0..K-1 of (out + rows[row_of[n*K + s]]) from
// +0: the gradient of a token's MoE input from its K expert rows. Reduces
// over the slot s.
void slot_sum(const float* rows, const int64_t* row_of, int K, int64_t N, int D, float* out);
// x[n][e] = x[n][e] + vec[e] for e < cols, rows of ld floats. Elementwise.
void add_row_vector(float* x, int64_t N, int64_t ld, int cols, const float* vec);
// The router gradient's z-loss term: dz[n][e] = dz[n][e] + ((two_zw * lse[n])
// / Ng) * g[n][e], two_zw = 2 * the z-loss weight. Elementwise.
void z_loss_grad(const float* g, const float* lse, int64_t N, int E, float two_zw, float Ng, float* dz);

}  // namespace ls::ops
