// lockstep-gpu-check: the CUDA kernels on a real GPU (tools/gpu-check builds
// and runs it). Each kernel runs on the device at several launch shapes on
// the same inputs as the CPU engine's op and must give its bits; then the
// contract GEMM is timed against cuBLAS fp32 and TF32 at 512-4096.
// Exit status 0 only when every comparison held.
//
// usage: lockstep-gpu-check [--only NAME] [--no-speed]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention.cuh"
#include "elementwise.cuh"
#include "gemm.cuh"
#include "gemm_bf16.cuh"
#include "moe.cuh"
#include "ops/attention.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "rmsnorm.cuh"
#include "weight_grad.cuh"

namespace {

int g_failed = 0, g_passed = 0;

#define CUDA_OK(call)                                                                                   \
  do {                                                                                                  \
    cudaError_t e_ = (call);                                                                            \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "gpu-check: %s failed: %s\n", #call, cudaGetErrorString(e_));                \
      std::exit(2);                                                                                     \
    }                                                                                                   \
  } while (0)

std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// A device copy of a host vector, freed at scope end.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    CUDA_OK(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)));
    if (n) CUDA_OK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit Dev(size_t count) : n(count) {
    CUDA_OK(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)));
    CUDA_OK(cudaMemset(p, 0, std::max<size_t>(1, n) * sizeof(T)));
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    if (n) CUDA_OK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

void expect_bits(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  CUDA_OK(cudaGetLastError());
  const bool same = got.size() == want.size() && std::memcmp(got.data(), want.data(), got.size() * 4) == 0;
  size_t first = 0;
  while (!same && first < got.size() && std::memcmp(&got[first], &want[first], 4) == 0) ++first;
  if (same) ++g_passed;
  else ++g_failed;
  std::printf("%-4s %s", same ? "ok" : "FAIL", what.c_str());
  if (!same && first < got.size())
    std::printf("  (first difference at %zu: %.9g vs %.9g)", first, got[first], want[first]);
  std::printf("\n");
}

unsigned blocks_for(int64_t n, unsigned per) { return (unsigned)((n + per - 1) / per); }

void check_gemm() {
  struct Shape {
    int64_t M, N, K;
  };
  for (const Shape& s : {Shape{5, 7, 3}, Shape{33, 65, 17}, Shape{128, 96, 257}, Shape{512, 512, 512}}) {
    const auto a = random_floats(s.M * s.K, 1), b = random_floats(s.K * s.N, 2), c0 = random_floats(s.M * s.N, 3);
    for (bool accumulate : {false, true}) {
      std::vector<float> want = c0;
      ls::ops::gemm(s.M, s.N, s.K, {a.data(), s.K, 1}, {b.data(), s.N, 1}, want.data(), s.N, accumulate);
      Dev<float> da(a), db(b), dc(c0);
      ls::kernels::contract_gemm<<<ls::kernels::contract_gemm_grid(s.M, s.N), ls::kernels::contract_gemm_block()>>>(
          s.M, s.N, s.K, {da.p, s.K, 1}, {db.p, s.N, 1}, dc.p, s.N, accumulate);
      expect_bits("contract_gemm " + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) +
                      (accumulate ? " accumulate" : ""),
                  dc.host(), want);
    }
  }
}

void check_weight_grad() {
  const int in = 40, out = 24;
  const std::vector<int64_t> off = {0, 5, 5, 16, 33, 64};
  const int64_t leaves = (int64_t)off.size() - 1, rows = off.back();
  const auto X = random_floats(rows * in, 4), dY = random_floats(rows * out, 5);
  std::vector<float> want(in * out);
  ls::ops::weight_grad(X.data(), in, dY.data(), out, in, out, off.data(), leaves, want.data());
  for (dim3 block : {dim3(1, 1), dim3(16, 8), dim3(32, 8)}) {
    Dev<float> dx(X), ddy(dY), dw((size_t)in * out);
    Dev<int64_t> doff(off);
    ls::kernels::weight_grad_leaves<<<dim3(blocks_for(out, block.x), blocks_for(in, block.y)), block>>>(
        dx.p, in, ddy.p, out, in, out, doff.p, leaves, dw.p);
    expect_bits("weight_grad_leaves block " + std::to_string(block.x) + "x" + std::to_string(block.y), dw.host(), want);
  }
}

// numerics.precision=bf16: the bf16 GEMM against the engine's
// ops::gemm_bf16_rounded, with edge values (subnormals, ties, +-0) mixed in.
void check_gemm_bf16() {
  struct Shape {
    int64_t M, N, K;
  };
  auto edgy = [](std::vector<float> v) {
    for (size_t i = 0; i < v.size(); i += 5) {
      const uint32_t u = ls::bits(v[i]);
      const uint32_t kinds[] = {u & 0x807fffffu, (u & 0xffff0000u) | 0x8000u, u & 0x80000000u,
                                (u & 0x807fffffu) | (uint32_t)(40 + i % 40) << 23};
      v[i] = ls::from_bits(kinds[i / 5 % 4]);
    }
    return v;
  };
  for (const Shape& s : {Shape{5, 7, 3}, Shape{33, 65, 17}, Shape{128, 96, 257}, Shape{512, 512, 512}}) {
    const auto a = edgy(random_floats(s.M * s.K, 41)), b = edgy(random_floats(s.K * s.N, 42)),
               c0 = edgy(random_floats(s.M * s.N, 43));
    for (bool accumulate : {false, true}) {
      std::vector<float> want = c0;
      ls::ops::gemm_bf16_rounded(s.M, s.N, s.K, {a.data(), s.K, 1}, {b.data(), 1, s.K}, want.data(), s.N, accumulate);
      Dev<float> da(a), db(b), dc(c0);
      ls::kernels::contract_gemm_bf16<<<ls::kernels::contract_gemm_bf16_grid(s.M, s.N),
                                        ls::kernels::contract_gemm_bf16_block()>>>(
          s.M, s.N, s.K, {da.p, s.K, 1}, {db.p, 1, s.K}, dc.p, s.N, accumulate);
      expect_bits("contract_gemm_bf16 " + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" +
                      std::to_string(s.K) + (accumulate ? " accumulate" : ""),
                  dc.host(), want);
    }
  }
}

// The bf16 weight gradient against its rule, written out on the host: per
// leaf ls::bf16_dot of the rounded rows from +0, leaves by ls::LeafTree.
void check_weight_grad_bf16() {
  const int in = 40, out = 24;
  const std::vector<int64_t> off = {0, 5, 5, 38, 71, 135};
  const int64_t leaves = (int64_t)off.size() - 1, rows = off.back();
  const auto X = random_floats(rows * in, 44), dY = random_floats(rows * out, 45);
  std::vector<uint16_t> x16(X.size()), dy16(dY.size());
  for (size_t i = 0; i < X.size(); ++i) x16[i] = ls::to_bf16(X[i]);
  for (size_t i = 0; i < dY.size(); ++i) dy16[i] = ls::to_bf16(dY[i]);
  std::vector<float> scratch((size_t)ls::LeafTree::levels_for(leaves) * in * out);
  ls::LeafTree tree(scratch.data(), (int64_t)in * out);
  for (int64_t l = 0; l < leaves; ++l) {
    float* leaf = tree.next_leaf();
    for (int i = 0; i < in; ++i)
      for (int j = 0; j < out; ++j)
        leaf[i * out + j] = ls::bf16_dot(x16.data() + off[l] * in + i, in, dy16.data() + off[l] * out + j, out,
                                         off[l + 1] - off[l], 0.0f);
    tree.push();
  }
  const float* sum = tree.finish();
  const std::vector<float> want(sum, sum + (size_t)in * out);
  for (dim3 block : {dim3(1, 1), dim3(16, 8)}) {
    Dev<float> dx(X), ddy(dY), dw((size_t)in * out);
    Dev<int64_t> doff(off);
    ls::kernels::weight_grad_leaves_bf16<<<dim3(blocks_for(out, block.x), blocks_for(in, block.y)), block>>>(
        dx.p, in, ddy.p, out, in, out, doff.p, leaves, dw.p);
    expect_bits("weight_grad_leaves_bf16 block " + std::to_string(block.x) + "x" + std::to_string(block.y),
                dw.host(), want);
  }
}

void check_norms_and_elementwise() {
  const int64_t N = 77;
  const int D = 64;
  const auto x = random_floats(N * D, 6), w = random_floats(D, 7), dy = random_floats(N * D, 8);
  std::vector<float> y(N * D), r(N), dh(N * D), dw(D);
  ls::ops::rmsnorm(x.data(), w.data(), y.data(), r.data(), N, D, 1e-5f);
  ls::ops::rmsnorm_backward(x.data(), w.data(), r.data(), dy.data(), dh.data(), N, D, false);
  ls::ops::rmsnorm_weight_grad(x.data(), r.data(), dy.data(), N, D, 7, dw.data());
  for (unsigned block : {32u, 128u}) {
    Dev<float> dx(x), dwt(w), ddy(dy), dyv((size_t)(N * D)), dr((size_t)N), ddh((size_t)(N * D)), ddw((size_t)D);
    ls::kernels::rmsnorm_forward<<<blocks_for(N, block), block>>>(dx.p, dwt.p, dyv.p, dr.p, N, D, 1e-5f);
    ls::kernels::rmsnorm_backward<<<blocks_for(N, block), block>>>(dx.p, dwt.p, dr.p, ddy.p, ddh.p, N, D, false);
    ls::kernels::rmsnorm_weight_grad<<<blocks_for(D, block), block>>>(dx.p, dr.p, ddy.p, N, D, 7, ddw.p);
    const std::string b = " block " + std::to_string(block);
    expect_bits("rmsnorm_forward" + b, dyv.host(), y);
    expect_bits("rmsnorm_forward r" + b, dr.host(), r);
    expect_bits("rmsnorm_backward" + b, ddh.host(), dh);
    expect_bits("rmsnorm_weight_grad" + b, ddw.host(), dw);
  }
  const int64_t n = 5000;
  const auto u = random_floats(n, 9), v = random_floats(n, 10), dact = random_floats(n, 11);
  std::vector<float> s(n), act(n), du(n), dv(n);
  ls::ops::swiglu(u.data(), v.data(), s.data(), act.data(), n);
  ls::ops::swiglu_backward(u.data(), v.data(), s.data(), dact.data(), du.data(), dv.data(), n);
  Dev<float> du_(u), dv_(v), dact_(dact), ds((size_t)n), dactv((size_t)n), ddu((size_t)n), ddv((size_t)n);
  ls::kernels::swiglu_forward<<<blocks_for(n, 256), 256>>>(du_.p, dv_.p, ds.p, dactv.p, n);
  ls::kernels::swiglu_backward<<<blocks_for(n, 256), 256>>>(du_.p, dv_.p, ds.p, dact_.p, ddu.p, ddv.p, n);
  expect_bits("swiglu_forward s", ds.host(), s);
  expect_bits("swiglu_forward act", dactv.host(), act);
  expect_bits("swiglu_backward du", ddu.host(), du);
  expect_bits("swiglu_backward dv", ddv.host(), dv);
  const int rows = 100, e = 64;
  auto z = random_floats(rows * e, 12);
  for (float& t : z) t *= 4.0f;
  std::vector<float> p(rows * e), lse(rows), dz(rows * e);
  ls::ops::softmax_rows(z.data(), e, p.data(), e, rows, e, 0, lse.data());
  const auto dp = random_floats(rows * e, 13);
  ls::ops::softmax_backward_rows(p.data(), e, dp.data(), e, dz.data(), e, rows, e, 0);
  Dev<float> dzin(z), dpv((size_t)(rows * e)), dlse((size_t)rows), ddp(dp), ddz((size_t)(rows * e));
  ls::kernels::softmax_rows<<<blocks_for(rows, 64), 64>>>(dzin.p, dpv.p, e, rows, e, dlse.p);
  ls::kernels::softmax_backward_rows<<<blocks_for(rows, 64), 64>>>(dpv.p, ddp.p, ddz.p, e, rows, e);
  expect_bits("softmax_rows", dpv.host(), p);
  expect_bits("softmax_rows lse", dlse.host(), lse);
  expect_bits("softmax_backward_rows", ddz.host(), dz);
  const int64_t np = 70001;
  const auto g = random_floats(np, 14);
  const float want = ls::ops::param_sumsq(g.data(), np);
  const int64_t blocks = (np + ls::kParamBlock - 1) / ls::kParamBlock;
  Dev<float> dg(g), dsums((size_t)blocks), dout((size_t)1);
  ls::kernels::sumsq_blocks<<<blocks_for(blocks, 32), 32>>>(dg.p, np, dsums.p);
  ls::kernels::tree_over_blocks<<<1, 1>>>(dsums.p, blocks, dout.p);
  expect_bits("gradient norm (sumsq_blocks + tree_over_blocks)", dout.host(), {want});
}

void check_attention() {
  for (int S : {17, 64}) {
    const int hd = 16;
    const int64_t ld = 3 * hd;
    const auto qkv = random_floats(S * ld, 15), dO = random_floats(S * hd, 16);
    const float scale = 1.0f / std::sqrt((float)hd);
    const size_t pf = (size_t)ls::ops::attention_probs_floats(S);
    std::vector<float> P(pf, 0.0f), o(S * hd), dq(S * hd), dk(S * hd), dv(S * hd);
    ls::ops::AttentionScratch sc;
    ls::ops::attention_forward(qkv.data(), qkv.data() + hd, qkv.data() + 2 * hd, ld, S, hd, scale, P.data(), o.data(),
                               hd, sc);
    ls::ops::attention_backward(qkv.data(), qkv.data() + hd, qkv.data() + 2 * hd, ld, S, hd, scale, P.data(),
                                dO.data(), hd, dq.data(), dk.data(), dv.data(), hd, sc);
    Dev<float> dqkv(qkv), ddO(dO), dP(pf), ddS(pf), dov((size_t)(S * hd)), ddq((size_t)(S * hd)),
        ddk((size_t)(S * hd)), ddv((size_t)(S * hd));
    ls::kernels::attention_forward_rows<<<blocks_for(S, 32), 32>>>(dqkv.p, dqkv.p + hd, dqkv.p + 2 * hd, ld, S, hd,
                                                                    scale, dP.p, dov.p, hd, false);
    ls::kernels::attention_backward_rows<<<blocks_for(S, 32), 32>>>(dqkv.p + hd, dqkv.p + 2 * hd, ld, S, hd, scale,
                                                                     dP.p, ddO.p, hd, ddS.p, ddq.p, hd);
    ls::kernels::attention_backward_cols<<<blocks_for(S, 32), 32>>>(dqkv.p, ld, S, hd, dP.p, ddS.p, ddO.p, hd, ddk.p,
                                                                     ddv.p, hd);
    const std::string s = " S=" + std::to_string(S);
    expect_bits("attention_forward o" + s, dov.host(), o);
    expect_bits("attention_backward dq" + s, ddq.host(), dq);
    expect_bits("attention_backward dk" + s, ddk.host(), dk);
    expect_bits("attention_backward dv" + s, ddv.host(), dv);
  }
}

// Context parallel: the query ranges of a sequence, chained in ascending
// order as mesh.cp does (zigzag cp=2 of 64: four ranges of 16), every head of
// a 2-sample batch; the kernels against the engine's range functions.
void check_attention_ranges() {
  const int B = 2, H = 2, hd = 16, S = 64, D = H * hd;
  const int firsts[] = {0, 16, 32, 48}, count = 16;
  const auto qkv = random_floats((size_t)B * S * 3 * D, 27), dO = random_floats((size_t)B * S * D, 28);
  const float scale = 1.0f / std::sqrt((float)hd);
  int64_t per_head = 0;
  for (int f : firsts) per_head += ls::ops::attention_range_probs_floats(count, f);
  std::vector<float> P((size_t)(B * H * per_head), 0.0f), o((size_t)B * S * D), dqkv((size_t)B * S * 3 * D, 0.0f);
  Dev<float> dq(qkv), ddO(dO), dP(P.size()), dov(o.size()), dd(dqkv.size());
  const size_t ds_floats = (size_t)H * ls::kernels::attention_probs_floats_range(count, S);
  Dev<float> dS(ds_floats);
  int64_t p_off = 0;
  for (int f : firsts) {
    ls::ops::attention_forward_range_heads(qkv.data(), B, H, S, hd, scale, f, count, {P.data()}, per_head, p_off,
                                           o.data());
    ls::kernels::attention_forward_range_heads<<<dim3(blocks_for(count, 32), B * H), 32>>>(
        dq.p, H, S, hd, scale, f, count, dP.p, per_head, p_off, dov.p, false);
    p_off += ls::ops::attention_range_probs_floats(count, f);
  }
  p_off = 0;
  for (int k = 0; k < 4; ++k) {
    const int f = firsts[k];
    for (int b = 0; b < B; ++b) {
      ls::ops::attention_backward_range_heads(qkv.data(), b, H, S, hd, scale, f, count, {P.data()}, per_head, p_off,
                                              dO.data(), dqkv.data(), k > 0);
      ls::kernels::attention_backward_range_rows<<<dim3(blocks_for(count, 32), H), 32>>>(
          dq.p, b, H, S, hd, scale, f, count, dP.p, per_head, p_off, ddO.p, dS.p, dd.p);
      ls::kernels::attention_backward_range_cols<<<dim3(blocks_for(f + count, 32), H), 32>>>(
          dq.p, b, H, S, hd, f, count, dP.p, per_head, p_off, dS.p, ddO.p, dd.p, k > 0);
    }
    p_off += ls::ops::attention_range_probs_floats(count, f);
  }
  expect_bits("attention ranges o", dov.host(), o);
  expect_bits("attention ranges dqkv (dK, dV chained over 4 ranges)", dd.host(), dqkv);
}

void check_adamw() {
  ls::OptimConfig cfg;
  const int64_t n = 4096;
  auto w = random_floats(n, 17), g = random_floats(n, 18), m = random_floats(n, 19), v = random_floats(n, 20);
  for (float& x : v) x = x * x;
  Dev<float> dw(w), dg(g), dm(m), dv(v);
  const int step = 6;
  ls::adamw_update(cfg, 3e-4f, step, true, 0.5f, {ls::AdamWSlice{w.data(), g.data(), m.data(), v.data(), n, true}});
  float p1 = 1.0f, p2 = 1.0f;
  for (int t = 0; t <= step; ++t) p1 = p1 * cfg.beta1, p2 = p2 * cfg.beta2;
  const ls::kernels::AdamWArgs a{cfg.beta1, cfg.beta2, 1.0f - cfg.beta1, 1.0f - cfg.beta2, 1.0f - p1, 1.0f - p2,
                                 cfg.eps, cfg.weight_decay, 3e-4f, 0.5f, true, true};
  ls::kernels::adamw_step<<<blocks_for(n, 256), 256>>>(dw.p, dg.p, dm.p, dv.p, n, a);
  expect_bits("adamw_step w", dw.host(), w);
  expect_bits("adamw_step m", dm.host(), m);
  expect_bits("adamw_step v", dv.host(), v);
}

void check_moe() {
  const int64_t N = 300;
  const int E = 8, K = 2, D = 64;
  const auto g = random_floats(N * E, 23), ye = random_floats(N * K * D, 24), res = random_floats(N * D, 25),
             dh = random_floats(N * D, 26);
  std::vector<int> sel(N * K);
  ls::ops::route_topk(g.data(), N, E, K, sel.data());
  std::vector<int64_t> row_of(N * K);
  for (int64_t q = 0; q < N * K; ++q) row_of[q] = (q * 17) % (N * K);
  std::vector<float> hout(N * D), dg(N * E, 0.0f), dye(N * K * D);
  ls::ops::moe_combine(g.data(), E, sel.data(), K, row_of.data(), ye.data(), nullptr, res.data(), hout.data(), N, D);
  ls::ops::moe_combine_backward(dh.data(), g.data(), E, sel.data(), K, row_of.data(), ye.data(), dg.data(), dye.data(), N, D);
  Dev<float> dgv(g), dyev(ye), dres(res), ddh(dh), dhout((size_t)(N * D)), ddg((size_t)(N * E)), ddye((size_t)(N * K * D));
  Dev<int> dsel((size_t)(N * K));
  Dev<int64_t> drow(row_of);
  ls::kernels::route_topk<<<blocks_for(N, 64), 64>>>(dgv.p, N, E, K, dsel.p);
  ls::kernels::moe_combine<<<blocks_for(N, 64), 64>>>(dgv.p, E, dsel.p, K, drow.p, dyev.p, nullptr, dres.p, dhout.p, N, D);
  ls::kernels::moe_combine_backward<<<blocks_for(N * K, 64), 64>>>(ddh.p, dgv.p, E, dsel.p, K, drow.p, dyev.p, ddg.p,
                                                                   ddye.p, N, D);
  const std::vector<int> ksel = dsel.host();
  const bool same_sel = ksel == sel;
  std::printf("%-4s route_topk\n", same_sel ? "ok" : "FAIL");
  same_sel ? ++g_passed : ++g_failed;
  expect_bits("moe_combine", dhout.host(), hout);
  expect_bits("moe_combine_backward dg", ddg.host(), dg);
  expect_bits("moe_combine_backward dye", ddye.host(), dye);
}

// The MoE dispatch and the step's small kernels: row copies by index lists,
// slot sums, the router gradient's terms, adds, fills, swiglu_product.
void check_dispatch() {
  const int64_t N = 300;
  const int K = 2, D = 64, E = 8;
  const auto rows = random_floats(N * K * D, 31), a = random_floats(N * D, 32), b = random_floats(N * D, 33),
             g = random_floats(N * E, 34), lse = random_floats(N, 35), vec = random_floats(E, 36),
             dz0 = random_floats(N * E, 37), u = random_floats(N * D, 38), v = random_floats(N * D, 39);
  std::vector<int64_t> row_of(N * K), src(N * K), dst(N * K);
  for (int64_t q = 0; q < N * K; ++q) row_of[q] = (q * 17) % (N * K), src[q] = (q * 7 + 3) % (N * K), dst[q] = N * K - 1 - q;
  std::vector<float> copied(N * K * D), summed(N * D), added(N * D), dz = dz0, sg(N * D), act(N * D), prod(N * D);
  ls::ops::copy_rows(rows.data(), src.data(), copied.data(), dst.data(), N * K, D);
  ls::ops::slot_sum(rows.data(), row_of.data(), K, N, D, summed.data());
  ls::ops::add(a.data(), b.data(), added.data(), N * D);
  ls::ops::add_row_vector(dz.data(), N, E, E, vec.data());
  ls::ops::z_loss_grad(g.data(), lse.data(), N, E, 2e-3f, 1200.0f, dz.data());
  ls::ops::swiglu(u.data(), v.data(), sg.data(), act.data(), N * D);
  ls::ops::swiglu_product(u.data(), sg.data(), v.data(), prod.data(), N * D);
  for (unsigned block : {64u, 256u}) {
    Dev<float> drows(rows), da(a), db(b), dg(g), dlse(lse), dvec(vec), ddz(dz0), du(u), dv(v), dsg(sg);
    Dev<float> dcopied((size_t)(N * K * D)), dsum((size_t)(N * D)), dadd((size_t)(N * D)), dprod((size_t)(N * D));
    Dev<int64_t> drow(row_of), dsrc(src), ddst(dst);
    ls::kernels::copy_rows<<<blocks_for(N * K * D, block), block>>>(drows.p, dsrc.p, dcopied.p, ddst.p, N * K, D);
    ls::kernels::slot_sum<<<blocks_for(N * D, block), block>>>(drows.p, drow.p, K, N, D, dsum.p);
    ls::kernels::add<<<blocks_for(N * D, block), block>>>(da.p, db.p, dadd.p, N * D);
    ls::kernels::add_row_vector<<<blocks_for(N * E, block), block>>>(ddz.p, N, E, E, dvec.p);
    ls::kernels::z_loss_grad<<<blocks_for(N * E, block), block>>>(dg.p, dlse.p, N, E, 2e-3f, 1200.0f, ddz.p);
    ls::kernels::swiglu_product<<<blocks_for(N * D, block), block>>>(du.p, dsg.p, dv.p, dprod.p, N * D);
    const std::string at = " block " + std::to_string(block);
    expect_bits("copy_rows" + at, dcopied.host(), copied);
    expect_bits("slot_sum" + at, dsum.host(), summed);
    expect_bits("add" + at, dadd.host(), added);
    expect_bits("add_row_vector + z_loss_grad" + at, ddz.host(), dz);
    expect_bits("swiglu_product" + at, dprod.host(), prod);
    ls::kernels::fill<<<blocks_for(N * D, block), block>>>(dadd.p, N * D, -0.0f);
    expect_bits("fill" + at, dadd.host(), std::vector<float>(N * D, -0.0f));
  }
}

// GFLOP/s of the contract GEMM and of cuBLAS fp32 and TF32 at n x n x n.
void speed() {
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    std::printf("speed: cuBLAS unavailable\n");
    return;
  }
  cudaEvent_t t0, t1;
  CUDA_OK(cudaEventCreate(&t0));
  CUDA_OK(cudaEventCreate(&t1));
  std::printf("\n%-6s %16s %16s %16s %10s %10s\n", "n", "contract GFLOP/s", "cuBLAS fp32", "cuBLAS TF32",
              "fp32/ctr", "TF32/ctr");
  for (int n : {512, 1024, 2048, 4096}) {
    const auto a = random_floats((size_t)n * n, 21), b = random_floats((size_t)n * n, 22);
    Dev<float> da(a), db(b), dc((size_t)n * n);
    auto time_it = [&](auto&& launch) {
      launch();  // warm-up
      CUDA_OK(cudaEventRecord(t0));
      const int reps = n <= 1024 ? 20 : 5;
      for (int i = 0; i < reps; ++i) launch();
      CUDA_OK(cudaEventRecord(t1));
      CUDA_OK(cudaEventSynchronize(t1));
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, t0, t1));
      return 2.0 * n * n * (double)n * reps / (ms * 1e-3) * 1e-9;
    };
    const double contract = time_it([&] {
      ls::kernels::contract_gemm<<<ls::kernels::contract_gemm_grid(n, n), ls::kernels::contract_gemm_block()>>>(
          n, n, n, {da.p, n, 1}, {db.p, n, 1}, dc.p, n, false);
    });
    const float one = 1.0f, zero = 0.0f;
    cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
    const double fp32 = time_it([&] {
      cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, db.p, n, da.p, n, &zero, dc.p, n);
    });
    cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH);
    const double tf32 = time_it([&] {
      cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, db.p, n, da.p, n, &zero, dc.p, n);
    });
    std::printf("%-6d %16.0f %16.0f %16.0f %10.2f %10.2f\n", n, contract, fp32, tf32, fp32 / contract, tf32 / contract);
  }
  cublasDestroy(h);
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  bool with_speed = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--no-speed") with_speed = false;
    else {
      std::fprintf(stderr, "usage: lockstep-gpu-check [--only gemm|weight_grad|gemm_bf16|weight_grad_bf16|norms|attention|adamw|moe|dispatch] [--no-speed]\n");
      return 2;
    }
  }
  int device = 0;
  cudaDeviceProp prop;
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::fprintf(stderr, "gpu-check: no CUDA device\n");
    return 3;
  }
  std::printf("gpu-check on %s (sm_%d%d), kernels vs the CPU engine, bit for bit\n", prop.name, prop.major, prop.minor);
  if (only.empty() || only == "gemm") check_gemm();
  if (only.empty() || only == "weight_grad") check_weight_grad();
  if (only.empty() || only == "gemm_bf16") check_gemm_bf16();
  if (only.empty() || only == "weight_grad_bf16") check_weight_grad_bf16();
  if (only.empty() || only == "norms") check_norms_and_elementwise();
  if (only.empty() || only == "attention") check_attention();
  if (only.empty() || only == "attention") check_attention_ranges();
  if (only.empty() || only == "adamw") check_adamw();
  if (only.empty() || only == "moe") check_moe();
  if (only.empty() || only == "dispatch") check_dispatch();
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  if (with_speed && only.empty()) speed();
  return g_failed ? 1 : 0;
}
