// The engine against the scalar reference, bit for bit: single ops, the
// weight-gradient leaf tree, and whole training steps at 1-4 threads.
#include <doctest/doctest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "bits.h"
#include "common/precision.h"
#include "contract.h"
#include "data/corpus.h"
#include "ops.h"  // reference/ops.h
#include "ops/attention.h"
#include "ops/gemm.h"
#include "ops/ops.h"
#include "runner/data_lanes.h"
#include "runner/execution_target.h"
#include "runner/runner.h"
#include "runner/scenario.h"

namespace {

std::vector<float> random_vec(size_t n, uint64_t seed, float a = 1.0f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = ls::random_symmetric(seed, ls::Purpose::kTest, i, a);
  return v;
}

ls::Scenario tiny_scenario(const std::string& overrides_json, std::vector<std::string> sets = {}) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8, "d_ff": 12},
    "moe": {"experts": 4, "top_k": 2, "aux_loss_weight": 0.05, "z_loss_weight": 0.01},
    "train": {"steps": 3, "batch": 4, "warmup_steps": 1, "eval_every": 0, "eval_batches": 1},
    "data": {"synthetic_bytes": 8192}})");
  j.merge_patch(nlohmann::json::parse(overrides_json));
  return ls::scenario_from_json(j, "engine-test.json", sets);
}

struct Trace {
  std::vector<float> losses, norms;
  std::vector<std::string> hashes;
};

Trace train(const ls::Scenario& s, ls::Backend backend, int threads) {
  omp_set_num_threads(threads);
  // The run's precision, process-wide for the engine's ops, as run_scenario installs it.
  const ls::ops::ScopedExecutionTarget installed(ls::execution_target(
      backend, ls::NumericsLevel::kPortable, ls::precision_of(s.precision)));
  ls::Corpus corpus = ls::load_corpus(s.data, s.seed, s.model.seq_len);
  auto trainer = ls::make_trainer(s, backend);
  std::vector<uint8_t> batch((size_t)s.batch * (s.model.seq_len + 1));
  Trace t;
  for (int step = 0; step < s.steps; ++step) {
    ls::train_batch(corpus, s.seed, step, s.batch, s.model.seq_len, batch.data());
    float norm = 0;
    t.losses.push_back(trainer->train_step(batch.data(), s.batch, step, &norm));
    t.norms.push_back(norm);
    t.hashes.push_back(trainer->state_hash());
  }
  ls::eval_batch(corpus, s.seed, 0, s.batch, s.model.seq_len, batch.data());
  t.losses.push_back(trainer->eval_loss(batch.data(), s.batch));
  return t;
}

// Turns data lanes (runner/data_lanes.h) on or off while alive, back on after.
struct LanesGuard {
  explicit LanesGuard(bool on) { ls::set_data_lanes_enabled(on); }
  ~LanesGuard() { ls::set_data_lanes_enabled(true); }
};

void check_engine_matches_reference(const ls::Scenario& s) {
  const Trace ref = train(s, ls::Backend::kReference, 1);
  // Several threads run either as data lanes (where they keep the bits) or
  // split every op; both must give the reference's bits.
  for (auto [threads, lanes] : {std::pair{1, true}, std::pair{2, true}, std::pair{2, false}, std::pair{3, true},
                                std::pair{4, true}, std::pair{4, false}}) {
    CAPTURE(threads);
    CAPTURE(lanes);
    LanesGuard guard(lanes);
    const Trace eng = train(s, ls::Backend::kEngine, threads);
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      CAPTURE(i);
      CHECK(ls::hex_bits(eng.losses[i]) == ls::hex_bits(ref.losses[i]));
    }
    for (size_t i = 0; i < ref.norms.size(); ++i) CHECK(ls::hex_bits(eng.norms[i]) == ls::hex_bits(ref.norms[i]));
    for (size_t i = 0; i < ref.hashes.size(); ++i) {
      CAPTURE(i);
      CHECK(eng.hashes[i] == ref.hashes[i]);
    }
  }
  omp_set_num_threads(omp_get_num_procs());
}

// fn(path name) on every instruction-set path this CPU has, set in turn and
// captured in failures; the automatic choice again afterwards, however fn ends.
template <class Fn>
void on_every_gemm_path(Fn fn) {
  struct Restore {
    ~Restore() { ls::ops::set_gemm_path(ls::ops::GemmPath::kAuto); }
  } restore;
  for (auto path : {ls::ops::GemmPath::kScalar, ls::ops::GemmPath::kAvx2, ls::ops::GemmPath::kAvx512}) {
    if (!ls::ops::gemm_path_supported(path)) continue;
    ls::ops::set_gemm_path(path);
    const std::string path_name = ls::ops::gemm_path_name();
    CAPTURE(path_name);
    fn(path_name);
  }
}

}  // namespace

TEST_SUITE("engine") {
  TEST_CASE("rmsnorm forward and backward equal the reference bitwise") {
    // Widths that are multiples of the 8-feature blocks and ones with a tail;
    // N leaves a group of fewer than 8 tokens.
    for (int D : {24, 13, 64, 5}) {
      CAPTURE(D);
      const int N = 37;
      auto x = random_vec(N * D, 1, 3.0f), w = random_vec(D, 2), dy = random_vec(N * D, 3);
      std::vector<float> y(N * D), r(N), dh(N * D), ry(N * D), rr(N), rdx(N * D);
      ls::ops::rmsnorm(x.data(), w.data(), y.data(), r.data(), N, D, 1e-5f);
      ls::ops::rmsnorm_backward(x.data(), w.data(), r.data(), dy.data(), dh.data(), N, D, false);
      for (int n = 0; n < N; ++n) {
        rr[n] = ref::rmsnorm(&x[n * D], w.data(), &ry[n * D], D, 1e-5f);
        ref::rmsnorm_backward(&x[n * D], w.data(), rr[n], &dy[n * D], &rdx[n * D], D);
      }
      CHECK_SAME_BITS(y, ry);
      CHECK_SAME_BITS(r, rr);
      CHECK_SAME_BITS(dh, rdx);
      // accumulate = true adds the same gradient to what dh holds.
      std::vector<float> acc = dy, want(N * D);
      ls::ops::rmsnorm_backward(x.data(), w.data(), r.data(), dy.data(), acc.data(), N, D, true);
      for (int i = 0; i < N * D; ++i) want[i] = dy[i] + rdx[i];
      CHECK_SAME_BITS(acc, want);
    }
  }

  TEST_CASE("dots8, sums8: eight sequential folds in lanes equal the scalar folds") {
    for (int n : {0, 1, 5, 8, 13, 64, 67}) {
      CAPTURE(n);
      std::vector<std::vector<float>> a(8), b(8);
      for (int r = 0; r < 8; ++r) {
        a[r] = random_vec(n + 1, 100 + r * 7 + n, 4.0f);
        b[r] = random_vec(n + 1, 200 + r * 7 + n, 4.0f);
      }
      if (n >= 3) {
        a[1][2] = std::numeric_limits<float>::quiet_NaN();          // a NaN row
        a[2][n - 1] = std::numeric_limits<float>::infinity();       // an infinite row
        for (int i = 0; i < n; ++i) a[3][i] = -0.0f;                // every product -0: the fold stays +0
        a[4][0] = 1e30f, b[4][0] = 1e30f, a[4][1] = -1e30f, b[4][1] = 1e30f;  // overflow then inf - inf
      }
      const float *pa[8], *pb[8];
      for (int r = 0; r < 8; ++r) pa[r] = a[r].data(), pb[r] = b[r].data();
      float out[8], sums[8], squares[8];
      ls::ops::dots8(pa, pb, n, out);
      ls::ops::sums8(pa, n, sums);
      ls::ops::dots8(pa, pa, n, squares);  // one operand: its own path
      for (int r = 0; r < 8; ++r) {
        float want = 0.0f, want_sum = 0.0f, want_sq = 0.0f;
        for (int i = 0; i < n; ++i) want = ls::fma(a[r][i], b[r][i], want);
        for (int i = 0; i < n; ++i) want_sum = want_sum + a[r][i];
        for (int i = 0; i < n; ++i) want_sq = ls::fma(a[r][i], a[r][i], want_sq);
        CHECK(ls::bits(out[r]) == ls::bits(want));
        CHECK(ls::bits(sums[r]) == ls::bits(want_sum));
        CHECK(ls::bits(squares[r]) == ls::bits(want_sq));
      }
    }
  }

  TEST_CASE("softmax and its backward equal the reference bitwise") {
    for (int n : {1, 2, 7, 64, 256}) {
      auto z = random_vec(n, 10 + n, 8.0f), dp = random_vec(n, 20 + n);
      std::vector<float> p(n), dz(n), rp(n), rdz(n);
      float lse = ls::ops::softmax(z.data(), p.data(), n);
      float rlse = ref::softmax(z.data(), rp.data(), n);
      ls::ops::softmax_backward(p.data(), dp.data(), dz.data(), n);
      ref::softmax_backward(rp.data(), dp.data(), rdz.data(), n);
      CHECK(ls::bits(lse) == ls::bits(rlse));
      CHECK_SAME_BITS(p, rp);
      CHECK_SAME_BITS(dz, rdz);
    }
  }

  TEST_CASE("softmax_rows and softmax_backward_rows equal softmax row by row") {
    // Uniform rows (lm_head, router) and causal rows of growing length (attention).
    for (int rows : {1, 7, 8, 9, 19}) {
      for (auto [n0, step] : {std::pair{256, 0}, std::pair{8, 0}, std::pair{1, 1}, std::pair{3, 2}}) {
        CAPTURE(rows);
        CAPTURE(n0);
        const int ld = n0 + step * rows + 3;
        auto z = random_vec((size_t)rows * ld, 300 + rows + n0, 8.0f), dp = random_vec((size_t)rows * ld, 400 + rows);
        std::vector<float> p((size_t)rows * ld), lse(rows), dz((size_t)rows * ld), rp((size_t)rows * ld),
            rdz((size_t)rows * ld);
        ls::ops::softmax_rows(z.data(), ld, p.data(), ld, rows, n0, step, lse.data());
        ls::ops::softmax_backward_rows(p.data(), ld, dp.data(), ld, dz.data(), ld, rows, n0, step);
        for (int r = 0; r < rows; ++r) {
          const int n = n0 + r * step;
          const float rl = ls::ops::softmax(&z[(size_t)r * ld], &rp[(size_t)r * ld], n);
          ls::ops::softmax_backward(&rp[(size_t)r * ld], &dp[(size_t)r * ld], &rdz[(size_t)r * ld], n);
          CHECK(ls::bits(lse[r]) == ls::bits(rl));
          for (int e = 0; e < n; ++e) {
            REQUIRE(ls::bits(p[(size_t)r * ld + e]) == ls::bits(rp[(size_t)r * ld + e]));
            REQUIRE(ls::bits(dz[(size_t)r * ld + e]) == ls::bits(rdz[(size_t)r * ld + e]));
          }
        }
      }
    }
  }

  TEST_CASE("softmax_rows finds the scan's maximum: signed zeros, NaN, infinities, ties") {
    // Rows where a vector max could differ from `m = z[0]; if (z[e] > m) m = z[e]`:
    // the maximum is +0 or -0 (first one kept), a NaN first or later, +-inf,
    // every entry equal; lengths below, at and above the vector paths.
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    for (int n : {1, 7, 8, 15, 16, 17, 31, 40, 256}) {
      for (int kind = 0; kind < 9; ++kind) {
        std::vector<float> z = random_vec(n, 900 + n + kind, 4.0f);
        for (float& x : z) x = -std::fabs(x) - 1.0f;  // all negative ...
        const int a = n / 3, b = (2 * n) / 3;
        switch (kind) {
          case 0: z[a] = -0.0f; z[b] = 0.0f; break;   // ... but a -0 first, then a +0
          case 1: z[a] = 0.0f; z[b] = -0.0f; break;
          case 2: z[0] = nan; break;
          case 3: z[b] = nan; break;
          case 4: z[a] = inf; break;
          case 5: z[a] = -inf; z[b] = -inf; break;
          case 6: std::fill(z.begin(), z.end(), -inf); break;
          case 7: std::fill(z.begin(), z.end(), 2.5f); break;
          default: z[n - 1] = 3.0f; break;               // the maximum in the scalar tail
        }
        CAPTURE(n);
        CAPTURE(kind);
        std::vector<float> p(n), rp(n), lse(1);
        ls::ops::softmax_rows(z.data(), n, p.data(), n, 1, n, 0, lse.data());
        const float rl = ls::ops::softmax(z.data(), rp.data(), n);
        CHECK(ls::bits(lse[0]) == ls::bits(rl));
        for (int e = 0; e < n; ++e) REQUIRE(ls::bits(p[e]) == ls::bits(rp[e]));
      }
    }
  }

  TEST_CASE("causal attention head, forward and backward, equals the reference bitwise") {
    // Every head width path (register-blocked 8/16/32-multiples, scalar otherwise) on every
    // instruction-set path, sequences shorter and longer than a row block, and strided q/k/v
    // as the model lays them out.
    on_every_gemm_path([&](const std::string&) {
      for (int hd : {3, 8, 16, 24, 32, 48, 64, 96, 128}) {
        for (int S : {1, 5, 13, 64}) {
          CAPTURE(hd);
          CAPTURE(S);
          const int64_t ld = 3 * hd + 5, ldo = hd + 3, ldd = 3 * hd + 1;
          const float scale = 1.0f / ls::sqrt((float)hd);
          auto qkv = random_vec((size_t)S * ld, 1000 + hd * 7 + S, 2.0f), dO = random_vec((size_t)S * ldo, 2000 + S);
          const float *q = qkv.data(), *k = q + hd, *v = q + 2 * hd;
          std::vector<float> P((size_t)ls::ops::attention_probs_floats(S)), o((size_t)S * ldo), rP((size_t)S * S),
              ro((size_t)S * ldo);
          ls::ops::AttentionScratch sc;
          ls::ops::attention_forward(q, k, v, ld, S, hd, scale, P.data(), o.data(), ldo, sc);
          ref::attention_head(q, k, v, ld, S, hd, scale, rP.data(), ro.data(), ldo);
          for (int t = 0; t < S; ++t)  // P's row t holds u <= t; o's rows hold hd features
            for (int u = 0; u <= t; ++u)
              REQUIRE(ls::bits(ls::ops::attention_prob(P.data(), S, t, u)) == ls::bits(rP[(size_t)t * S + u]));
          for (int t = 0; t < S; ++t)
            for (int j = 0; j < hd; ++j) REQUIRE(ls::bits(o[(size_t)t * ldo + j]) == ls::bits(ro[(size_t)t * ldo + j]));
          std::vector<float> d((size_t)S * ldd * 3, 0.0f), rd((size_t)S * ldd * 3, 0.0f);
          ls::ops::attention_backward(q, k, v, ld, S, hd, scale, P.data(), dO.data(), ldo, d.data(), d.data() + hd,
                                      d.data() + 2 * hd, ldd, sc);
          ref::attention_head_backward(q, k, v, ld, S, hd, scale, rP.data(), dO.data(), ldo, rd.data(), rd.data() + hd,
                                       rd.data() + 2 * hd, ldd);
          for (int t = 0; t < S; ++t)
            for (int j = 0; j < 3 * hd; ++j)
              REQUIRE(ls::bits(d[(size_t)t * ldd + j]) == ls::bits(rd[(size_t)t * ldd + j]));
        }
      }
    });
  }

  TEST_CASE("attention over query ranges, chained in ascending order, gives the whole sequence's bits") {
    // What a context-parallel rank computes: its query range against every
    // earlier key, dK and dV continuing the folds of the ranges before it.
    // Ranges of every size (a lone row, ranges that start and end inside a
    // 16-block, the zigzag halves) on every instruction-set path.
    on_every_gemm_path([&](const std::string&) {
      for (int hd : {3, 8, 16, 32, 64}) {
        for (const std::vector<int>& cuts : std::vector<std::vector<int>>{
                 {0, 13}, {0, 1, 13}, {0, 5, 9, 13}, {0, 16, 32, 48, 64}, {0, 8, 16, 24, 32, 40, 48, 56, 64},
                 {0, 3, 20, 21, 37, 64}, {0, 40, 64}}) {
          const int S = cuts.back();
          CAPTURE(hd);
          CAPTURE(S);
          CAPTURE(cuts.size());
          const int64_t ld = 3 * hd + 5, ldo = hd + 3, ldd = 3 * hd + 1;
          const float scale = 1.0f / ls::sqrt((float)hd);
          auto qkv = random_vec((size_t)S * ld, 3000 + hd * 7 + S, 2.0f), dO = random_vec((size_t)S * ldo, 4000 + S);
          const float *q = qkv.data(), *k = q + hd, *v = q + 2 * hd;
          std::vector<float> P((size_t)ls::ops::attention_probs_floats(S)), o((size_t)S * ldo);
          ls::ops::AttentionScratch sc;
          ls::ops::attention_forward(q, k, v, ld, S, hd, scale, P.data(), o.data(), ldo, sc);
          std::vector<float> d((size_t)S * ldd, 0.0f);
          ls::ops::attention_backward(q, k, v, ld, S, hd, scale, P.data(), dO.data(), ldo, d.data(), d.data() + hd,
                                      d.data() + 2 * hd, ldd, sc);
          // The ranges: q, dO, o, dq in buffers of their own rows; dk, dv one
          // buffer the ranges hand on in ascending order.
          std::vector<float> dkv((size_t)S * 2 * hd, 0.0f);
          for (size_t c = 0; c + 1 < cuts.size(); ++c) {
            const int t_off = cuts[c], Q = cuts[c + 1] - cuts[c];
            std::vector<float> ql((size_t)Q * hd), dOl((size_t)Q * hd), ol((size_t)Q * hd), dql((size_t)Q * hd),
                Pl((size_t)ls::ops::attention_range_probs_floats(Q, t_off));
            for (int i = 0; i < Q; ++i)
              for (int j = 0; j < hd; ++j) {
                ql[(size_t)i * hd + j] = q[(size_t)(t_off + i) * ld + j];
                dOl[(size_t)i * hd + j] = dO[(size_t)(t_off + i) * ldo + j];
              }
            ls::ops::attention_forward_range(ql.data(), hd, k, v, ld, Q, t_off, hd, scale, Pl.data(), ol.data(), hd,
                                             sc);
            for (int i = 0; i < Q; ++i) {
              for (int u = 0; u <= t_off + i; ++u)
                REQUIRE(ls::bits(ls::ops::attention_range_prob(Pl.data(), Q, t_off, i, u)) ==
                        ls::bits(ls::ops::attention_prob(P.data(), S, t_off + i, u)));
              for (int j = 0; j < hd; ++j)
                REQUIRE(ls::bits(ol[(size_t)i * hd + j]) == ls::bits(o[(size_t)(t_off + i) * ldo + j]));
            }
            ls::ops::attention_backward_range(ql.data(), hd, k, v, ld, Q, t_off, hd, scale, Pl.data(), dOl.data(),
                                              hd, dql.data(), hd, dkv.data(), dkv.data() + hd, 2 * hd, c > 0, sc);
            for (int i = 0; i < Q; ++i)
              for (int j = 0; j < hd; ++j)
                REQUIRE(ls::bits(dql[(size_t)i * hd + j]) == ls::bits(d[(size_t)(t_off + i) * ldd + j]));
          }
          for (int u = 0; u < S; ++u)
            for (int j = 0; j < 2 * hd; ++j)
              REQUIRE(ls::bits(dkv[(size_t)u * 2 * hd + j]) == ls::bits(d[(size_t)u * ldd + hd + j]));
        }
      }
    });
  }

  TEST_CASE("a range's backward as dS and dq, then dK and dV a key block at a time, gives the whole range's bits") {
    // The context-parallel chain pipelined over key blocks (model/context_parallel.cc): per head, then per
    // block of 16 keys, against attention_backward_range_heads, the ranges chained in ascending order.
    on_every_gemm_path([&](const std::string&) {
      for (int hd : {3, 8, 16, 32}) {
        for (const std::vector<int>& cuts :
             std::vector<std::vector<int>>{{0, 13, 40}, {0, 16, 48, 64}, {0, 20, 37, 64}, {0, 64}}) {
          CAPTURE(hd);
          CAPTURE(cuts.size());
          const int H = 2, D = H * hd, S = cuts.back();
          const float scale = 1.0f / ls::sqrt((float)hd);
          auto qkv = random_vec((size_t)S * 3 * D, 5000 + hd + S, 2.0f), dO = random_vec((size_t)S * D, 6000 + S);
          std::vector<float> o((size_t)S * D), whole((size_t)S * 3 * D, 0.0f), split(whole.size(), 0.0f);
          for (size_t c = 0; c + 1 < cuts.size(); ++c) {
            const int first = cuts[c], count = cuts[c + 1] - cuts[c], end = cuts[c + 1];
            const int64_t per = ls::ops::attention_range_probs_floats(count, first);
            std::vector<float> P((size_t)(H * per)), dS((size_t)per);
            ls::ops::attention_forward_range_heads(qkv.data(), 1, H, S, hd, scale, first, count, {P.data()}, per, 0,
                                                   o.data());
            ls::ops::attention_backward_range_heads(qkv.data(), 0, H, S, hd, scale, first, count, {P.data()}, per, 0,
                                                    dO.data(), whole.data(), c > 0);
            for (int h = 0; h < H; ++h) {
              ls::ops::attention_backward_range_dq_heads(qkv.data(), 0, H, h, h + 1, S, hd, scale, first, count,
                                                         {P.data()}, per, 0, dO.data(), dS.data(), split.data());
              for (int u0 = 0; u0 < end; u0 += 16)
                ls::ops::attention_backward_range_dkv_heads(qkv.data(), 0, H, h, h + 1, S, hd, first, count, {P.data()},
                                                            per, 0, dS.data(), dO.data(), split.data(), u0,
                                                            std::min(end, u0 + 16));
            }
          }
          for (size_t i = 0; i < whole.size(); ++i) REQUIRE(ls::bits(split[i]) == ls::bits(whole[i]));
        }
      }
    });
  }

  TEST_CASE("at bf16 P is rounded to bf16, and keeping it as bf16 a chunk at a time gives the fp32 store's bits") {
    // numerics.precision=bf16 rounds P before P V (ops/attention.h, ProbsStore). The CPU engine keeps it in
    // 16 bits, running kProbsChunk queries at a time: the whole batch's and a context-parallel chain's
    // outputs and gradients must be the fp32 store's bits, and the stored values its entries.
    struct Restore {
      ~Restore() { ls::precision_slot().store(static_cast<int>(ls::Precision::kFp32)); }
    } restore;
    on_every_gemm_path([&](const std::string&) {
      for (int S : {37, 300}) {  // 300: three chunks, the last with a part block
        CAPTURE(S);
        const int B = 2, H = 2, hd = 16, D = H * hd;
        const float scale = 1.0f / ls::sqrt((float)hd);
        const auto qkv = random_vec((size_t)B * S * 3 * D, 7100 + S, 2.0f), dO = random_vec((size_t)B * S * D, 7200 + S);
        const int64_t per = ls::ops::attention_probs_floats(S), n = B * H * per;
        std::vector<float> o32((size_t)B * S * D), o16(o32.size()), d32((size_t)B * S * 3 * D), d16(d32.size());
        // At fp32 P holds values bf16 cannot: the rounding below is a real one.
        std::vector<float> Pfp32((size_t)n);
        ls::ops::attention_forward_heads(qkv.data(), B, H, S, hd, scale, {Pfp32.data()}, o32.data());
        int64_t unrounded = 0;
        for (float p : Pfp32) unrounded += ls::from_bf16(ls::to_bf16(p)) != p;
        CHECK(unrounded > 0);
        ls::precision_slot().store(static_cast<int>(ls::Precision::kBf16));
        std::vector<float> P32((size_t)n);
        std::vector<uint16_t> P16((size_t)n, 0);
        ls::ops::attention_forward_heads(qkv.data(), B, H, S, hd, scale, {P32.data()}, o32.data());
        ls::ops::attention_forward_heads(qkv.data(), B, H, S, hd, scale, {nullptr, P16.data()}, o16.data());
        for (int bh = 0; bh < B * H; ++bh)
          for (int t = 0; t < S; ++t)
            for (int u = 0; u <= t; ++u) {
              const float p = ls::ops::attention_prob(P32.data() + bh * per, S, t, u);
              REQUIRE(ls::bits(p) == ls::bits(ls::from_bf16(ls::to_bf16(p))));
            }
        std::vector<float> P16f((size_t)n);
        for (int64_t i = 0; i < n; ++i) P16f[(size_t)i] = ls::from_bf16(P16[(size_t)i]);
        for (int bh = 0; bh < B * H; ++bh)
          for (int t = 0; t < S; ++t)
            for (int u = 0; u <= t; ++u)
              REQUIRE(ls::bits(ls::ops::attention_prob(P16f.data() + bh * per, S, t, u)) ==
                      ls::bits(ls::ops::attention_prob(P32.data() + bh * per, S, t, u)));
        for (size_t i = 0; i < o32.size(); ++i) REQUIRE(ls::bits(o16[i]) == ls::bits(o32[i]));
        ls::ops::attention_backward_heads(qkv.data(), B, H, S, hd, scale, {P32.data()}, dO.data(), d32.data());
        std::fill(d16.begin(), d16.end(), 1.0f);  // what a reused buffer holds: the bf16 store zeroes dk, dv itself
        ls::ops::attention_backward_heads(qkv.data(), B, H, S, hd, scale, {nullptr, P16.data()}, dO.data(), d16.data());
        for (size_t i = 0; i < d32.size(); ++i) REQUIRE(ls::bits(d16[i]) == ls::bits(d32[i]));
        // A context-parallel chain over query ranges of sample 0: the whole-range backward, and dq then dk, dv
        // a block of 16 keys at a time, each from a bf16 store, against the fp32 store.
        const std::vector<int> cuts = {0, S / 3, S};
        std::vector<float> whole((size_t)S * 3 * D, 0.0f), split(whole.size(), 0.0f), ref(whole.size(), 0.0f);
        for (size_t c = 0; c + 1 < cuts.size(); ++c) {
          const int first = cuts[c], count = cuts[c + 1] - cuts[c], end = cuts[c + 1];
          const int64_t rp = ls::ops::attention_range_probs_floats(count, first);
          std::vector<float> R32((size_t)(H * rp)), dS((size_t)rp), o((size_t)S * D);
          std::vector<uint16_t> R16((size_t)(H * rp), 0);
          ls::ops::attention_forward_range_heads(qkv.data(), 1, H, S, hd, scale, first, count, {R32.data()}, rp, 0,
                                                 o.data());
          ls::ops::attention_forward_range_heads(qkv.data(), 1, H, S, hd, scale, first, count, {nullptr, R16.data()},
                                                 rp, 0, o.data());
          ls::ops::attention_backward_range_heads(qkv.data(), 0, H, S, hd, scale, first, count, {R32.data()}, rp, 0,
                                                  dO.data(), ref.data(), c > 0);
          ls::ops::attention_backward_range_heads(qkv.data(), 0, H, S, hd, scale, first, count, {nullptr, R16.data()},
                                                  rp, 0, dO.data(), whole.data(), c > 0);
          for (int h = 0; h < H; ++h) {
            ls::ops::attention_backward_range_dq_heads(qkv.data(), 0, H, h, h + 1, S, hd, scale, first, count,
                                                       {nullptr, R16.data()}, rp, 0, dO.data(), dS.data(), split.data());
            for (int u0 = 0; u0 < end; u0 += 16)
              ls::ops::attention_backward_range_dkv_heads(qkv.data(), 0, H, h, h + 1, S, hd, first, count,
                                                          {nullptr, R16.data()}, rp, 0, dS.data(), dO.data(),
                                                          split.data(), u0, std::min(end, u0 + 16));
          }
        }
        for (size_t i = 0; i < ref.size(); ++i) {
          REQUIRE(ls::bits(whole[i]) == ls::bits(ref[i]));
          REQUIRE(ls::bits(split[i]) == ls::bits(ref[i]));
        }
        ls::precision_slot().store(static_cast<int>(ls::Precision::kFp32));
      }
    });
  }

  TEST_CASE("causal attention head: NaN, infinite and tied scores give the reference's bits") {
    // Special scores (NaN, +-inf, inf - inf, all-equal rows) through the
    // blocked softmax and the folds must come out as the reference's bits,
    // NaN payloads included, on every instruction-set path.
    const int S = 37, hd = 16;
    const int64_t ld = 3 * hd, ldo = hd, ldd = 3 * hd;
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    on_every_gemm_path([&](const std::string&) {
      auto qkv = random_vec((size_t)S * ld, 77, 2.0f), dO = random_vec((size_t)S * ldo, 78);
      float *q = qkv.data(), *k = q + hd, *v = q + 2 * hd;
      q[3 * ld + 2] = nan;                                  // row 3: every score NaN
      k[7 * ld + 0] = inf;                                  // key 7: +-inf or NaN scores
      for (int j = 0; j < hd; ++j) q[20 * ld + j] = 0.0f;   // row 20: all scores +0 (a tie)
      k[30 * ld + 5] = -inf;                                // key 30: -inf or NaN scores
      k[9 * ld + 0] = inf;                                  // key 9: inf - inf = NaN for some rows
      k[9 * ld + 1] = -inf;
      k[12 * ld + 3] = nan;                                 // key 12: a NaN inside finite rows
      std::vector<float> P((size_t)ls::ops::attention_probs_floats(S)), o((size_t)S * ldo), rP((size_t)S * S),
          ro((size_t)S * ldo);
      ls::ops::AttentionScratch sc;
      ls::ops::attention_forward(q, k, v, ld, S, hd, 0.25f, P.data(), o.data(), ldo, sc);
      ref::attention_head(q, k, v, ld, S, hd, 0.25f, rP.data(), ro.data(), ldo);
      for (int t = 0; t < S; ++t)
        for (int u = 0; u <= t; ++u) {
          CAPTURE(t);
          CAPTURE(u);
          REQUIRE(ls::bits(ls::ops::attention_prob(P.data(), S, t, u)) == ls::bits(rP[(size_t)t * S + u]));
        }
      for (size_t i = 0; i < o.size(); ++i) REQUIRE(ls::bits(o[i]) == ls::bits(ro[i]));
      std::vector<float> d((size_t)S * ldd, 0.0f), rd((size_t)S * ldd, 0.0f);
      ls::ops::attention_backward(q, k, v, ld, S, hd, 0.25f, P.data(), dO.data(), ldo, d.data(), d.data() + hd,
                                  d.data() + 2 * hd, ldd, sc);
      ref::attention_head_backward(q, k, v, ld, S, hd, 0.25f, rP.data(), dO.data(), ldo, rd.data(), rd.data() + hd,
                                   rd.data() + 2 * hd, ldd);
      for (size_t i = 0; i < d.size(); ++i) REQUIRE(ls::bits(d[i]) == ls::bits(rd[i]));
    });
  }

  TEST_CASE("weight_grad: leaf tree over tokens, any leaf sizes, any threads, any tiling, every ISA path") {
    // Shapes: full register tiles (64 x 128), edge rows and columns, one
    // 8-row block, several column groups, a single column; row strides wider
    // than the rows (as the expert buffers are read).
    struct Shape {
      int in, out;
    };
    // Leaf offsets: uneven with empty leaves (as an expert sees them), one
    // leaf, no rows at all, leaves that start past row 0, and 37 leaves (a
    // deep, irregular tree).
    std::vector<std::vector<int64_t>> offsets = {
        {0, 5, 5, 17, 18, 30, 30, 30, 53}, {0, 53}, {0, 0, 0}, {7, 12, 12, 40}, {}};
    for (int l = 0; l <= 37; ++l) offsets.back().push_back(l * 53 / 37);
    const int N = 53;
    on_every_gemm_path([&](const std::string& path_name) {
      for (Shape sh : {Shape{19, 150}, Shape{70, 40}, Shape{64, 128}, Shape{8, 32}, Shape{13, 37}, Shape{6, 1},
                       Shape{33, 300}}) {
        const int in = sh.in, out = sh.out, ldx = in + 3, ldy = out + 5;
        auto X = random_vec(N * ldx, 4 + in, 2.0f), dY = random_vec(N * ldy, 5 + out, 2.0f);
        for (const std::vector<int64_t>& off : offsets) {
          const int64_t leaves = (int64_t)off.size() - 1;
          std::vector<float> want(in * out);
          for (int i = 0; i < in; ++i)
            for (int j = 0; j < out; ++j) {
              std::vector<float> part(leaves);
              for (int64_t l = 0; l < leaves; ++l) {
                float acc = 0.0f;
                for (int64_t n = off[l]; n < off[l + 1]; ++n) acc = ls::fma(X[n * ldx + i], dY[n * ldy + j], acc);
                part[l] = acc;
              }
              want[i * out + j] = ref::tree(part.data(), leaves);
            }
          for (int threads : {1, 2, 3, 4}) {
            omp_set_num_threads(threads);
            std::vector<float> got(in * out, -1.0f);
            ls::ops::weight_grad(X.data(), ldx, dY.data(), ldy, in, out, off.data(), leaves, got.data());
            CAPTURE(path_name);
            CAPTURE(threads);
            CAPTURE(in);
            CAPTURE(out);
            CAPTURE(leaves);
            CHECK_SAME_BITS(got, want);
          }
        }
      }
    });
    omp_set_num_threads(omp_get_num_procs());
  }

  TEST_CASE("param_sumsq: sixteen or eight blocks side by side give the contract's bits") {
    const int64_t B = ls::kParamBlock;
    for (int64_t n : {int64_t(0), int64_t(1), B - 1, B, B + 1, 8 * B, 8 * B + 5, 16 * B, 17 * B + 3, 24 * B + 7,
                      int64_t(100003)}) {
      CAPTURE(n);
      auto v = random_vec((size_t)n, 77 + n, 3.0f);
      CHECK(ls::bits(ls::ops::param_sumsq(v.data(), n)) == ls::bits(ls::param_sumsq(v.data(), n)));
    }
  }

  TEST_CASE("token_sum is the leaf tree, not a running sum") {
    // Leaves of 8: 3 | 1e8 | -1e8 | 3 | 0...: a running sum keeps the last 3,
    // the tree (3 + 1e8) + (-1e8 + 3) loses both.
    std::vector<float> v(96, 0.0f);
    v[0] = 3.0f;
    v[8] = 1e8f;
    v[16] = -1e8f;
    v[24] = 3.0f;
    float running = 0.0f;
    for (float x : v) running = running + x;
    const float leafy = ls::ops::token_sum(v.data(), 96, 8);
    float want = ref::token_reduce<float>(96, 8, [&](int64_t n, float acc) { return acc + v[n]; });
    CHECK(ls::bits(leafy) == ls::bits(want));
    CHECK(ls::bits(leafy) != ls::bits(running));  // the test can tell the orders apart
  }

  TEST_CASE("training steps equal the reference: top-2, aux and z-loss") {
    check_engine_matches_reference(tiny_scenario("{}"));
  }
  TEST_CASE("training steps equal the reference: top-1, 8 experts") {
    check_engine_matches_reference(tiny_scenario(R"({"moe": {"experts": 8, "top_k": 1}})"));
  }
  TEST_CASE("training steps equal the reference: top-k = E with a shared expert") {
    check_engine_matches_reference(tiny_scenario(R"({"moe": {"experts": 3, "top_k": 3}, "model": {"shared_expert": true}})"));
  }
  TEST_CASE("training steps equal the reference: leaves of 3 samples, odd shapes") {
    check_engine_matches_reference(tiny_scenario(
        R"({"model": {"d_model": 18, "n_heads": 3, "seq_len": 7, "d_ff": 5}, "moe": {"experts": 5, "top_k": 2},
            "train": {"batch": 6}, "numerics": {"leaf_samples": 3}})"));
  }
  TEST_CASE("training steps equal the reference: the sequence-wise aux loss, leaves of 1 and 3 samples") {
    check_engine_matches_reference(tiny_scenario(R"({"moe": {"aux_scope": "sequence", "aux_loss_weight": 0.1}})"));
    check_engine_matches_reference(tiny_scenario(
        R"({"model": {"d_model": 18, "n_heads": 3, "seq_len": 7, "d_ff": 5, "shared_expert": true},
            "moe": {"experts": 5, "top_k": 2, "aux_scope": "sequence", "aux_loss_weight": 0.1},
            "train": {"batch": 6}, "numerics": {"leaf_samples": 3}})"));
  }
  TEST_CASE("training steps equal the reference: grad clipping active, no aux losses") {
    check_engine_matches_reference(tiny_scenario(
        R"({"moe": {"aux_loss_weight": 0, "z_loss_weight": 0}, "train": {"grad_clip": 0.01, "lr": 0.01}})"));
  }

  TEST_CASE("bf16 training steps equal the reference, and are not fp32's: top-2, top-1, shared expert, leaves of 3") {
    // Widened to fold parts a multiple of 32 wide (the loader refuses less at bf16).
    for (const char* shape : {R"({"model": {"d_model": 32, "d_ff": 32}})",
                              R"({"model": {"d_model": 32, "d_ff": 32}, "moe": {"experts": 8, "top_k": 1}})",
                              R"({"moe": {"experts": 3, "top_k": 3}, "model": {"shared_expert": true, "d_model": 32,
                                  "d_ff": 64}})",
                              R"({"model": {"d_model": 96, "n_heads": 3, "seq_len": 7, "d_ff": 32}, "train": {"batch": 6},
                                  "numerics": {"leaf_samples": 3}})"}) {
      CAPTURE(shape);
      nlohmann::json j = nlohmann::json::parse(shape);
      const ls::Scenario fp32 = tiny_scenario(j.dump());
      j["numerics"]["precision"] = "bf16";
      const ls::Scenario bf16 = tiny_scenario(j.dump());
      check_engine_matches_reference(bf16);
      // Not the fp32 run: the engine and the reference both took the bf16 products.
      const Trace a = train(fp32, ls::Backend::kEngine, 1), b = train(bf16, ls::Backend::kEngine, 1),
                  r = train(bf16, ls::Backend::kReference, 1);
      CHECK(a.hashes.back() != b.hashes.back());
      CHECK(r.hashes.back() == b.hashes.back());
    }
  }

  TEST_CASE("data lanes: one model's bits and routing statistics, at 2 and 4 lanes") {
    // The default shape with 2-4 leaves per lane; a skewed router so that
    // rounds and borrowed rows are not trivial. Each lane runs its own rounds
    // over its own tokens (the capacity follows the tokens it holds), so the
    // executions differ while bits and routing do not.
    nlohmann::json j = nlohmann::json::parse(R"({"train": {"steps": 2, "batch": 8, "eval_every": 0},
        "moe": {"router_skew": 1.0, "capacity_factor": 0.5, "borrow": true},
        "data": {"synthetic_bytes": 65536}})");
    const ls::Scenario s = ls::scenario_from_json(j, "lanes.json", {});
    ls::Corpus corpus = ls::load_corpus(s.data, s.seed, s.model.seq_len);
    std::vector<uint8_t> batch((size_t)s.batch * (s.model.seq_len + 1));
    auto run = [&](int threads, bool lanes, std::string* executed) {
      LanesGuard guard(lanes);
      omp_set_num_threads(threads);
      auto trainer = ls::make_trainer(s, ls::Backend::kEngine);
      std::vector<std::string> out;
      for (int step = 0; step < s.steps; ++step) {
        ls::train_batch(corpus, s.seed, step, s.batch, s.model.seq_len, batch.data());
        float norm = 0;
        const float loss = trainer->train_step(batch.data(), s.batch, step, &norm);
        const ls::MeshReport m = trainer->mesh_report();
        std::string line = ls::hex_bits(loss) + " " + ls::hex_bits(norm) + " " + trainer->state_hash() + " tokens";
        for (int64_t c : trainer->tokens_per_expert()) line += " " + std::to_string(c);
        out.push_back(line);
        *executed += "rounds " + std::to_string(m.rounds) + " borrowed " + std::to_string(m.borrowed) + " calls " +
                     std::to_string(m.expert_gemm_calls) + "; ";
      }
      return out;
    };
    std::string whole, split, plain;
    const auto one = run(1, false, &whole);
    CHECK(whole.find("rounds 1 ") == std::string::npos);  // several rounds ran
    for (int threads : {2, 4}) {
      CAPTURE(threads);
      REQUIRE(ls::DataLanes::applicable(s.model, s.leaf_samples, 100000, s.batch, threads));  // not vacuous
      split.clear();
      CHECK(run(threads, true, &split) == one);
      CHECK(split != whole);  // the lanes executed other rounds
      CHECK(run(threads, false, &plain) == one);
    }
    omp_set_num_threads(omp_get_num_procs());
  }

  TEST_CASE("data lanes apply only where they keep the bits") {
    ls::ModelConfig m;
    CHECK(ls::DataLanes::applicable(m, 1, 1000, 16, 2));
    CHECK(ls::DataLanes::applicable(m, 2, 1000, 16, 4));      // 2 leaves per lane
    CHECK_FALSE(ls::DataLanes::applicable(m, 1, 1000, 16, 3));  // 16 samples do not split in 3
    CHECK_FALSE(ls::DataLanes::applicable(m, 1, 1000, 12, 2));  // 6 leaves per lane: not a tree node
    CHECK(ls::DataLanes::applicable(m, 3, 1000, 12, 2));        // 6 samples per lane: 2 leaves of 3
    CHECK_FALSE(ls::DataLanes::applicable(m, 3, 1000, 18, 2));  // 9 samples per lane: 3 leaves of 3
    CHECK_FALSE(ls::DataLanes::applicable(m, 3, 1000, 12, 3));  // 4 samples per lane: not whole leaves
    CHECK(ls::DataLanes::applicable(m, 3, 1000, 12, 4));        // 3 samples: one leaf per lane
    CHECK_FALSE(ls::DataLanes::applicable(m, 1, 1000, 16, 1));
    CHECK_FALSE(ls::DataLanes::applicable(m, 1, int64_t(1) << 28, 16, 2));  // a 1 GiB gradient per lane
    m.moe_policy = ls::MoePolicy::kDrop;  // capacity counts one model's tokens
    CHECK_FALSE(ls::DataLanes::applicable(m, 1, 1000, 16, 2));
    {
      LanesGuard off(false);
      CHECK_FALSE(ls::DataLanes::applicable(ls::ModelConfig{}, 1, 1000, 16, 2));
    }
  }

  TEST_CASE("default shape: engine bits do not depend on the thread count") {
    nlohmann::json j = nlohmann::json::parse(R"({"train": {"steps": 2, "eval_every": 0}, "data": {"synthetic_bytes": 65536}})");
    ls::Scenario s = ls::scenario_from_json(j, "default.json", {});
    const Trace one = train(s, ls::Backend::kEngine, 1);
    for (int threads : {2, 3, 4}) {
      CAPTURE(threads);
      const Trace many = train(s, ls::Backend::kEngine, threads);
      CHECK_SAME_BITS(many.losses, one.losses);
      CHECK(many.hashes == one.hashes);
    }
    omp_set_num_threads(omp_get_num_procs());
  }
}

TEST_SUITE("engine") {
  TEST_CASE("training learns: held-out bits per byte fall far below 8 within 150 steps") {
    nlohmann::json j = nlohmann::json::parse(R"({"train": {"steps": 150, "eval_every": 50, "eval_batches": 2}})");
    ls::Scenario s = ls::scenario_from_json(j, "learns.json", {});
    ls::RunOptions opt;
    opt.threads = 2;
    ls::RunResult r = ls::run_scenario(s, opt);
    REQUIRE(r.evals.size() == 3);
    MESSAGE("held-out bpb at steps 50/100/150: " << r.evals[0].bpb << " " << r.evals[1].bpb << " " << r.evals[2].bpb);
    CHECK(r.losses.front() / 0.6931f > 7.5f);  // starts near uniform (8 bits)
    CHECK(r.evals[2].bpb < 3.5f);
    CHECK(r.evals[2].bpb < r.evals[0].bpb);
    omp_set_num_threads(omp_get_num_procs());
  }
}
