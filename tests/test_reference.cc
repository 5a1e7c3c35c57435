// Gradient checks of the reference (reference/ops.h, reference/reference.h)
// in double precision against central finite differences. They do not lean
// on the numerics contract: T = double, libm math, and the only claim is
// calculus (backward == d forward), so an error here is a wrong formula, not
// a rounding question.
//
// Finite differences: Richardson-extrapolated central differences,
//   D(h) = (f(x+h) - f(x-h)) / 2h,  fd = (4 D(h/2) - D(h)) / 3,
// whose truncation error is O(h^4) and roundoff about eps*|f|/h. Error
// measure: |g - fd| / max(|g|, |fd|, 1e-8). A jump in f (a top-k routing
// flip inside [x-h, x+h]) shows as D(h) and D(h/2) disagreeing wildly; such a
// coordinate is retried with a 16x smaller step and, if still kinked,
// reported and skipped (it never passes as "checked"). Steps: h = 1e-4
// * max(1, |x|) for the single ops, 2e-3 * max(1, |w|) for the model (why:
// at kModelH below). Worst errors are printed by MESSAGE (run with -s).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"
#include "reference.h"

namespace {

// The test's own deterministic randomness (splitmix64), independent of the
// contract's Philox so that nothing here rests on code under test.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * (double)(next() >> 11) * 0x1p-53; }
  std::vector<double> vec(size_t n, double lo = -1, double hi = 1) {
    std::vector<double> v(n);
    for (double& x : v) x = uniform(lo, hi);
    return v;
  }
};

double rel_err(double g, double fd) {
  return std::fabs(g - fd) / std::max({std::fabs(g), std::fabs(fd), 1e-8});
}

struct Fd {
  double fd = 0;     // Richardson estimate
  bool kink = false; // D(h) and D(h/2) disagree: f is not smooth near x
};

// Derivative of f at x (f takes the coordinate's value). See the header
// comment: kink when the two central differences disagree by far more than
// the O(h^2) truncation term of a smooth function could explain.
Fd central_fd(const std::function<double(double)>& f, double x, double h) {
  double d1 = (f(x + h) - f(x - h)) / (2 * h);
  double d2 = (f(x + h / 2) - f(x - h / 2)) / h;
  Fd r;
  r.fd = (4 * d2 - d1) / 3;
  r.kink = std::fabs(d1 - d2) > 1e-3 * std::max({std::fabs(d1), std::fabs(d2), 1e-3});
  return r;
}

// One coordinate's verdict.
struct Verdict {
  double g = 0, fd = 0, err = 0;
  bool kink = false;
  bool ok(double tol) const { return !kink && err <= tol; }
};

// Compares analytic g against the FD of `loss` along x[i]; x[i] is restored.
Verdict check_coord(std::vector<double>& x, size_t i, double g, const std::function<double()>& loss,
                    double h) {
  const double x0 = x[i];
  auto f = [&](double xi) {
    x[i] = xi;
    double l = loss();
    x[i] = x0;
    return l;
  };
  Fd d = central_fd(f, x0, h);
  if (d.kink) d = central_fd(f, x0, h / 16);  // a flip at distance > h/16 is avoided
  Verdict v;
  v.g = g;
  v.fd = d.fd;
  v.kink = d.kink;
  v.err = rel_err(g, d.fd);
  return v;
}

// Worst error over a group of coordinates, reported by MESSAGE.
struct Worst {
  Worst(std::string what_, double tol_) : what(std::move(what_)), tol(tol_) {}
  std::string what;
  double tol;
  double err = 0;
  std::string where;
  int checked = 0;
  void add(const Verdict& v, const std::string& at) {
    ++checked;
    if (v.err > err) {
      err = v.err;
      where = at;
    }
    if (!v.ok(tol))
      FAIL_CHECK(what << " " << at << ": g=" << v.g << " fd=" << v.fd << " rel.err=" << v.err
                      << std::string(v.kink ? " (kink)" : "") << " > tol " << tol);
  }
  void report() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s: worst rel.err %.3g over %d coords (tol %.0e)%s%s", what.c_str(), err,
                  checked, tol, where.empty() ? "" : " at ", where.c_str());
    MESSAGE(buf);
    CHECK(checked > 0);
  }
};

// Checks every coordinate of x: g[i] against the FD of loss() along x[i].
void check_all(Worst& w, const char* name, std::vector<double>& x, const std::vector<double>& g,
               const std::function<double()>& loss, double h = 1e-4) {
  REQUIRE(g.size() == x.size());
  for (size_t i = 0; i < x.size(); ++i)
    w.add(check_coord(x, i, g[i], loss, h * std::max(1.0, std::fabs(x[i]))),
          std::string(name) + "[" + std::to_string(i) + "]");
}

// L = sum_i c_i * out_i: reduces over the output index i.
double weighted(const std::vector<double>& c, const double* out) {
  double s = 0;
  for (size_t i = 0; i < c.size(); ++i) s += c[i] * out[i];
  return s;
}

// Per-op tolerance: the ops are O(1)-sized smooth functions of O(1) inputs;
// Richardson FD with h = 1e-4 has negligible truncation and roundoff
// ~1e-16/1e-4 absolute. Measured worst 7e-10, so 1e-7 has two orders of
// margin while any wrong term (an error of order 1) still fails.
constexpr double kOpTol = 1e-7;

}  // namespace

TEST_SUITE("reference") {

TEST_CASE("op fd: rmsnorm dx and dw (rel.err <= 1e-7)") {
  const int D = 7;
  Rng rng(1);
  std::vector<double> x = rng.vec(D, -2, 2), w = rng.vec(D, 0.5, 1.5), c = rng.vec(D), out(D), dx(D), dw(D);
  const double eps = 1e-5;
  auto loss = [&] {
    ref::rmsnorm(x.data(), w.data(), out.data(), D, eps);
    return weighted(c, out.data());
  };
  double r = ref::rmsnorm(x.data(), w.data(), out.data(), D, eps);
  ref::rmsnorm_backward(x.data(), w.data(), r, c.data(), dx.data(), D);
  for (int i = 0; i < D; ++i) dw[i] = c[i] * x[i] * r;  // the model's norm_grad term, one token
  Worst wx{"rmsnorm dx", kOpTol}, ww{"rmsnorm dw", kOpTol};
  check_all(wx, "x", x, dx, loss);
  check_all(ww, "w", w, dw, loss);
  wx.report();
  ww.report();
}

TEST_CASE("op fd: softmax, softmax_backward, log-sum-exp (rel.err <= 1e-7)") {
  const int n = 6;
  Rng rng(2);
  std::vector<double> z = rng.vec(n, -3, 3), c = rng.vec(n), p(n), dz(n);
  auto loss = [&] {
    ref::softmax(z.data(), p.data(), n);
    return weighted(c, p.data());
  };
  ref::softmax(z.data(), p.data(), n);
  ref::softmax_backward(p.data(), c.data(), dz.data(), n);
  Worst ws{"softmax dz", kOpTol}, wl{"lse dz", kOpTol};
  check_all(ws, "z", z, dz, loss);
  // The returned log-sum-exp has gradient p (the z-loss path uses it).
  ref::softmax(z.data(), p.data(), n);
  const std::vector<double> dlse = p;  // copied: the loss below rewrites p
  check_all(wl, "z", z, dlse, [&] { return ref::softmax(z.data(), p.data(), n); });
  ws.report();
  wl.report();
}

TEST_CASE("op fd: silu_grad (rel.err <= 1e-7)") {
  Worst w{"silu_grad", kOpTol};
  for (double u : {-8.0, -3.0, -1.0, -0.3, 0.0, 0.2, 1.0, 2.5, 7.0}) {
    std::vector<double> x{u};
    std::vector<double> g{ref::silu_grad(u)};
    check_all(w, ("u=" + std::to_string(u)).c_str(), x, g, [&] { return ref::silu(x[0]); });
  }
  w.report();
}

TEST_CASE("op fd: SwiGLU expert dx, du, dv, dW1, dW3, dW2 (rel.err <= 1e-7)") {
  const int D = 5, F = 4;
  Rng rng(3);
  std::vector<double> x = rng.vec(D, -1.5, 1.5), W1 = rng.vec(D * F), W3 = rng.vec(D * F), W2 = rng.vec(F * D),
                      c = rng.vec(D);
  std::vector<double> u(F), v(F), act(F), y(D), du(F), dv(F), dx(D);
  auto loss = [&] {
    std::vector<double> u_(F), v_(F), a_(F), y_(D);
    ref::expert_forward(false, x.data(), W1.data(), W3.data(), W2.data(), D, F, u_.data(), v_.data(), a_.data(), y_.data());
    return weighted(c, y_.data());
  };
  ref::expert_forward(false, x.data(), W1.data(), W3.data(), W2.data(), D, F, u.data(), v.data(), act.data(), y.data());
  ref::expert_backward(false, u.data(), v.data(), W1.data(), W3.data(), W2.data(), c.data(), D, F, du.data(), dv.data(),
                       dx.data());
  // du, dv: FD of the hidden-side map (u, v) -> L with act = silu(u) * v,
  // y = act W2, built from the ops' own silu and dot_col.
  auto loss_uv = [&] {
    std::vector<double> a_(F);
    for (int f = 0; f < F; ++f) a_[f] = ref::silu(u[f]) * v[f];
    double l = 0;
    for (int j = 0; j < D; ++j) l += c[j] * ref::dot_col(false, a_.data(), W2.data(), D, j, F);
    return l;
  };
  // Weight gradients from the saved du, dv, act and dy = c (outer products,
  // as the model's token reductions form them for one token).
  std::vector<double> dW1(D * F), dW3(D * F), dW2(F * D);
  for (int i = 0; i < D; ++i)
    for (int f = 0; f < F; ++f) {
      dW1[i * F + f] = x[i] * du[f];
      dW3[i * F + f] = x[i] * dv[f];
    }
  for (int f = 0; f < F; ++f)
    for (int j = 0; j < D; ++j) dW2[f * D + j] = act[f] * c[j];
  Worst wx{"expert dx", kOpTol}, wu{"expert du", kOpTol}, wv{"expert dv", kOpTol}, w1{"expert dW1", kOpTol},
      w3{"expert dW3", kOpTol}, w2{"expert dW2", kOpTol};
  check_all(wx, "x", x, dx, loss);
  check_all(wu, "u", u, du, loss_uv);
  check_all(wv, "v", v, dv, loss_uv);
  check_all(w1, "W1", W1, dW1, loss);
  check_all(w3, "W3", W3, dW3, loss);
  check_all(w2, "W2", W2, dW2, loss);
  for (auto* w : {&wx, &wu, &wv, &w1, &w3, &w2}) w->report();
}

TEST_CASE("op fd: causal attention head dq, dk, dv (S=5, hd=3, rel.err <= 1e-7)") {
  // q, k, v interleaved in one buffer with row stride 3*hd, as in the model.
  const int S = 5, hd = 3, ld = 3 * hd;
  const double scale = 1 / std::sqrt((double)hd);
  Rng rng(4);
  std::vector<double> qkv = rng.vec(S * ld, -1.5, 1.5), c = rng.vec(S * hd);
  std::vector<double> P(S * S), o(S * hd), dqkv(S * ld, 0.0);
  auto loss = [&] {
    std::vector<double> P_(S * S), o_(S * hd);
    ref::attention_head(&qkv[0], &qkv[hd], &qkv[2 * hd], ld, S, hd, scale, P_.data(), o_.data(), hd);
    return weighted(c, o_.data());
  };
  ref::attention_head(&qkv[0], &qkv[hd], &qkv[2 * hd], ld, S, hd, scale, P.data(), o.data(), hd);
  ref::attention_head_backward(&qkv[0], &qkv[hd], &qkv[2 * hd], ld, S, hd, scale, P.data(), c.data(), hd,
                               &dqkv[0], &dqkv[hd], &dqkv[2 * hd], ld);
  Worst wq{"attention dq", kOpTol}, wk{"attention dk", kOpTol}, wv{"attention dv", kOpTol};
  for (int t = 0; t < S; ++t)
    for (int part = 0; part < 3; ++part)
      for (int j = 0; j < hd; ++j) {
        size_t i = (size_t)t * ld + part * hd + j;
        Worst& w = part == 0 ? wq : part == 1 ? wk : wv;
        w.add(check_coord(qkv, i, dqkv[i], loss, 1e-4 * std::max(1.0, std::fabs(qkv[i]))),
              "t=" + std::to_string(t) + " j=" + std::to_string(j));
      }
  // Causality: with only output row 0 weighted, no later q, k or v row
  // gets a gradient (exactly zero, not merely small).
  std::vector<double> c0(S * hd, 0.0), d0(S * ld, 0.0);
  std::copy(c.begin(), c.begin() + hd, c0.begin());
  ref::attention_head_backward(&qkv[0], &qkv[hd], &qkv[2 * hd], ld, S, hd, scale, P.data(), c0.data(), hd,
                               &d0[0], &d0[hd], &d0[2 * hd], ld);
  bool later_zero = true;
  for (size_t i = ld; i < d0.size(); ++i) later_zero &= d0[i] == 0.0;
  CHECK(later_zero);
  CHECK(d0[2 * hd] != 0.0);  // v row 0 does feed output row 0
  wq.report();
  wk.report();
  wv.report();
}

TEST_CASE("op fd: cross-entropy through softmax, dlogits = p - onehot (rel.err <= 1e-7)") {
  const int V = 9, target = 4;
  Rng rng(5);
  std::vector<double> z = rng.vec(V, -3, 3), p(V);
  ref::softmax(z.data(), p.data(), V);
  std::vector<double> g = p;
  g[target] -= 1;
  Worst w{"cross-entropy dlogits", kOpTol};
  // CE = lse(z) - z[target], the model's per-token loss.
  check_all(w, "z", z, g, [&] {
    std::vector<double> p_(V);
    return ref::softmax(z.data(), p_.data(), V) - z[target];
  });
  w.report();
}

TEST_CASE("fd checker: a 1% error in one op gradient is flagged") {
  const int D = 7;
  Rng rng(1);
  std::vector<double> x = rng.vec(D, -2, 2), w = rng.vec(D, 0.5, 1.5), c = rng.vec(D), out(D), dx(D);
  auto loss = [&] {
    ref::rmsnorm(x.data(), w.data(), out.data(), D, 1e-5);
    return weighted(c, out.data());
  };
  double r = ref::rmsnorm(x.data(), w.data(), out.data(), D, 1e-5);
  ref::rmsnorm_backward(x.data(), w.data(), r, c.data(), dx.data(), D);
  Verdict good = check_coord(x, 3, dx[3], loss, 1e-4);
  Verdict bad = check_coord(x, 3, dx[3] * 1.01, loss, 1e-4);
  CHECK(good.ok(kOpTol));
  CHECK_FALSE(bad.ok(kOpTol));
  CHECK(bad.err > 5e-3);
  // And a jump is reported as a kink, not as a derivative.
  Fd step = central_fd([](double t) { return t < 1e-5 ? 0.0 : 1e-3; }, 0.0, 1e-4);
  CHECK(step.kink);
  Fd smooth = central_fd([](double t) { return std::sin(t); }, 0.3, 1e-4);
  CHECK_FALSE(smooth.kink);
  CHECK(rel_err(std::cos(0.3), smooth.fd) < 1e-10);
}

}  // TEST_SUITE("reference")

// ------------------------------------------------------------ whole model --
namespace {

// Model check: |g - fd| / max(|g|, |fd|, 1e-8) <= 1e-5 on every
// coordinate checked (measured worst 5e-7: 20x margin).
// Step: h = 2e-3 * max(1, |w|) (the stencil also uses h/2). Why not 1e-6:
// the loss is ~6, so each D(h) carries roundoff ~1e-15 / h absolute, and
// the smallest gradients here are ~1e-6: over ~5500 coordinates, honest
// ones measured up to 1.6e-3 relative error at h = 1e-6 and 1.7e-5 at 1e-4,
// but 5e-7 at 2e-3 (Richardson keeps truncation O(h^4), not visible yet).
// Routing flips are the risk of a larger step; they are detected (kink,
// see the flip test) and retried at h/16 rather than avoided by luck. The
// nearest flip found along a router weight was 0.05 away (25 h).
constexpr double kModelTol = 1e-5;
constexpr double kModelH = 2e-3;

ref::Config small_config(bool shared) {
  ref::Config c;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.seq_len = 4;
  c.d_ff = 6;
  c.experts = 4;
  c.top_k = 2;
  c.batch = 2;
  c.shared_expert = shared;
  c.aux_loss_weight = 0.1f;
  c.z_loss_weight = 0.05f;
  c.leaf_samples = 1;
  // Larger than the training init so that attention and router softmaxes
  // are far from uniform and every path's gradient stands above FD noise.
  c.init_std = 0.3f;
  return c;
}

std::vector<uint8_t> token_batch(const ref::Config& c) {
  Rng rng(42);
  std::vector<uint8_t> t((size_t)c.batch * (c.seq_len + 1));
  for (auto& b : t) b = (uint8_t)(rng.next() & 255);
  return t;
}

// The coordinates checked: all of them (it costs ~1 s), except that tok_emb
// is restricted to the rows of bytes that occur as inputs plus the first
// unused row (whose gradient and FD must both be exactly zero).
std::vector<int64_t> coords_to_check(const ref::Param<double>& p, const ref::Config& c,
                                     const std::vector<uint8_t>& tokens) {
  std::vector<int64_t> idx;
  if (p.name != "tok_emb") {
    for (int64_t i = 0; i < p.size(); ++i) idx.push_back(i);
    return idx;
  }
  std::vector<bool> used((size_t)c.vocab, false);
  for (int b = 0; b < c.batch; ++b)
    for (int t = 0; t < c.seq_len; ++t) used[tokens[(size_t)b * (c.seq_len + 1) + t]] = true;
  bool unused_taken = false;
  for (int v = 0; v < c.vocab; ++v) {
    if (!used[(size_t)v]) {
      if (unused_taken) continue;
      unused_taken = true;
    }
    for (int i = 0; i < c.d_model; ++i) idx.push_back((int64_t)v * c.d_model + i);
  }
  return idx;
}

void check_model(bool shared) {
  const ref::Config c = small_config(shared);
  const std::vector<uint8_t> tokens = token_batch(c);
  ref::Model<double> m(c, 7);
  const ref::Losses<double> fb = m.forward_backward(tokens.data(), c.batch);
  const ref::Losses<double> f = m.forward(tokens.data(), c.batch);
  CHECK(f.total == fb.total);
  CHECK(fb.aux > 0);
  CHECK(fb.z > 0);
  MESSAGE("losses: ce " << fb.ce << " aux " << fb.aux << " z " << fb.z << " total " << fb.total);
  auto total = [&] { return m.forward(tokens.data(), c.batch).total; };
  Worst all{shared ? "model (shared expert on)" : "model (shared expert off)", kModelTol};
  int kinks = 0;
  for (ref::Param<double>& p : m.params) {
    const std::vector<double> g = p.g;  // forward() leaves p.g alone, but keep a copy regardless
    Worst wt{p.name, kModelTol};
    for (int64_t i : coords_to_check(p, c, tokens)) {
      Verdict v = check_coord(p.w, (size_t)i, g[(size_t)i], total, kModelH * std::max(1.0, std::fabs(p.w[(size_t)i])));
      if (v.kink) {
        ++kinks;
        MESSAGE("routing flip suspected at " << p.name << "[" << i << "]: coordinate skipped");
        continue;
      }
      wt.add(v, "[" + std::to_string(i) + "]");
      all.add(v, p.name + "[" + std::to_string(i) + "]");
    }
    wt.report();
  }
  all.report();
  // A skipped coordinate is not a checked one: none were seen at this seed;
  // allow a handful before the check counts as broken.
  MESSAGE(kinks << " coordinates skipped as routing flips");
  CHECK(kinks <= 3);
}

}  // namespace

TEST_SUITE("reference") {

TEST_CASE("model fd: every parameter coordinate, shared expert off (rel.err <= 1e-5)") { check_model(false); }
TEST_CASE("model fd: every parameter coordinate, shared expert on (rel.err <= 1e-5)") { check_model(true); }

TEST_CASE("fd checker: a 1% error in one model gradient is flagged") {
  const ref::Config c = small_config(true);
  const std::vector<uint8_t> tokens = token_batch(c);
  ref::Model<double> m(c, 7);
  m.forward_backward(tokens.data(), c.batch);
  auto total = [&] { return m.forward(tokens.data(), c.batch).total; };
  ref::Param<double>& p = m.param("layers.0.router");
  const size_t i = 5;
  const double g = p.g[i];
  REQUIRE(std::fabs(g) > 1e-6);
  Verdict good = check_coord(p.w, i, g, total, kModelH);
  Verdict bad = check_coord(p.w, i, g * 1.01, total, kModelH);
  CHECK(good.ok(kModelTol));
  CHECK_FALSE(bad.ok(kModelTol));
  MESSAGE("negative control: honest rel.err " << good.err << ", 1%-perturbed rel.err " << bad.err);
}

TEST_CASE("fd checker: a real top-k routing flip is detected as a kink") {
  // Walk one router weight in steps of h (so consecutive stencils cover the
  // whole range) until some token's top-k set changes: the loss jumps there.
  const ref::Config c = small_config(false);
  const std::vector<uint8_t> tokens = token_batch(c);
  ref::Model<double> m(c, 7);
  ref::Param<double>& p = m.param("layers.0.router");
  const size_t i = 3;
  const double w0 = p.w[i];
  auto f = [&](double x) {
    p.w[i] = x;
    double l = m.forward(tokens.data(), c.batch).total;
    p.w[i] = w0;
    return l;
  };
  CHECK_FALSE(central_fd(f, w0, kModelH).kink);
  int k = 1;
  Fd d;
  for (; k <= 200; ++k) {
    d = central_fd(f, w0 + k * kModelH, kModelH);
    if (d.kink) break;
  }
  REQUIRE_MESSAGE(k <= 200, "no routing flip within 0.4 of the weight");
  // Undetected, the jump would pose as a derivative far from the gradient.
  p.w[i] = w0 + k * kModelH;
  m.forward_backward(tokens.data(), c.batch);
  const double g = p.g[i];
  p.w[i] = w0;
  MESSAGE("flip " << k * kModelH << " from the weight: gradient " << g << ", jump-polluted fd " << d.fd);
  CHECK(rel_err(g, d.fd) > 1e-2);
}

}  // TEST_SUITE("reference")
