// Scenario loading: one table of rows (key, field accessor, doc, rules)
// drives decoding, validation, defaults, the resolved JSON and the docs.
// Adding a section (mesh.*, ckpt.*) means adding rows to rows(); a list-valued
// key such as `faults` needs a row with its own decode/encode functions.
#include "runner/scenario.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>

#include <xxhash.h>

#include "common/error.h"
#include "common/json_input.h"
#include "common/text.h"
#include "faults/fault_spec.h"

namespace ls {
namespace {

using json = nlohmann::json;

// Scenarios are written by hand; a bigger file is a mistake (or hostile).
constexpr size_t kMaxScenarioBytes = size_t(16) << 20;

// ---------------------------------------------------------------- values ---

// The shortest decimal that reads back as `f`, as a double, so the resolved
// JSON shows 0.003 rather than 0.003000000026077032. Falls back to the exact
// widening in the rare case where decimal->double->float would round twice.
double float_for_json(float f) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf - 1, f);
  *r.ptr = '\0';
  double d = std::strtod(buf, nullptr);
  return static_cast<float>(d) == f ? d : static_cast<double>(f);
}

// "string \"ten\"", "number 2.5", ... for error messages; long values cut.
std::string describe(const json& v) {
  std::string d = v.dump();
  if (d.size() > 48) d = d.substr(0, 45) + "...";
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean " + d;
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer " + d;
    case json::value_t::number_float: return "number " + d;
    case json::value_t::string: return "string " + d;
    case json::value_t::array: return "array " + d;
    case json::value_t::object: return "object " + d;
    default: return d;
  }
}

// A value in messages and docs: "0", "0.5", "1e-05" (no trailing ".0").
template <class T> std::string show(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    const double d = std::is_same_v<T, float> ? float_for_json(v) : v;
    if (d == std::floor(d) && std::fabs(d) < 1e15) return std::to_string(static_cast<int64_t>(d));
    return json(d).dump();
  } else {
    return std::to_string(v);
  }
}

// Type name in the schema and in "expected ..." messages.
template <class T> const char* type_name() {
  if constexpr (std::is_same_v<T, bool>) return "boolean";
  else if constexpr (std::is_integral_v<T>) return "integer";
  else if constexpr (std::is_floating_point_v<T>) return "number";
  else return "string";
}

// Decoders return "" on success, else the message (without key or origin).
template <class T> std::string decode_integer(const json& v, T* out) {
  using lim = std::numeric_limits<T>;
  const std::string range = "out of range [" + std::to_string(lim::min()) + ", " +
                            std::to_string(lim::max()) + "]";
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(lim::max())) return describe(v) + " " + range;
    *out = static_cast<T>(u);
  } else if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < static_cast<int64_t>(lim::min()) ||
        (i > 0 && static_cast<uint64_t>(i) > static_cast<uint64_t>(lim::max())))
      return describe(v) + " " + range;
    *out = static_cast<T>(i);
  } else if (v.is_number_float()) {
    // 1e6 is accepted as an integer; 2.5 is not.
    double d = v.get<double>();
    if (d != std::floor(d)) return "expected integer, got non-integral " + describe(v);
    const double lo = static_cast<double>(lim::min());            // 0 or -2^k: exact
    const double hi = std::ldexp(1.0, lim::digits);               // max + 1: exact
    if (!(d >= lo && d < hi)) return describe(v) + " " + range;
    *out = static_cast<T>(d);
  } else {
    return std::string("expected integer, got ") + describe(v);
  }
  return "";
}

template <class T> std::string decode_value(const json& v, T* out) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return "expected boolean, got " + describe(v);
    *out = v.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    return decode_integer(v, out);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return "expected number, got " + describe(v);
    double d = v.get<double>();
    if (std::is_same_v<T, float> && !(std::fabs(d) <= std::numeric_limits<float>::max()))
      return describe(v) + " out of range for binary32";
    *out = static_cast<T>(d);
  } else {
    if (!v.is_string()) return "expected string, got " + describe(v);
    *out = v.get<std::string>();
  }
  return "";
}

template <class T> json encode_value(const T& v) {
  if constexpr (std::is_same_v<T, float>) return json(float_for_json(v));
  else return json(v);
}

// ----------------------------------------------------------------- rules ---

// A constraint: its text for the docs and a check that names the violation.
template <class T> struct Rule {
  std::string text;
  std::function<std::string(const Scenario&, T)> fails;  // "" when v is fine
};

template <class T> Rule<T> in_range(T lo, T hi) {
  std::string r = "[" + show(lo) + ", " + show(hi) + "]";
  return {"in " + r, [=](const Scenario&, T v) {
            return v >= lo && v <= hi ? std::string() : "must be in " + r + ", got " + show(v);
          }};
}
template <class T> Rule<T> at_least(T lo) {
  return {">= " + show(lo), [=](const Scenario&, T v) {
            return v >= lo ? std::string() : "must be >= " + show(lo) + ", got " + show(v);
          }};
}
template <class T> Rule<T> above(T lo) {
  return {"> " + show(lo), [=](const Scenario&, T v) {
            return v > lo ? std::string() : "must be > " + show(lo) + ", got " + show(v);
          }};
}
template <class T> Rule<T> in_half_open(T lo, T hi) {  // [lo, hi)
  std::string r = "[" + show(lo) + ", " + show(hi) + ")";
  return {"in " + r, [=](const Scenario&, T v) {
            return v >= lo && v < hi ? std::string() : "must be in " + r + ", got " + show(v);
          }};
}
template <class T> Rule<T> in_open_closed(T lo, T hi) {  // (lo, hi]
  std::string r = "(" + show(lo) + ", " + show(hi) + "]";
  return {"in " + r, [=](const Scenario&, T v) {
            return v > lo && v <= hi ? std::string() : "must be in " + r + ", got " + show(v);
          }};
}
// A string that must be one of `names`: "a, b or c" in the docs and in
// "must be a, b or c, got "d"".
Rule<std::string> one_of(std::vector<std::string> names) {
  std::string list;
  for (size_t i = 0; i < names.size(); ++i)
    list += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return {list, [names, list](const Scenario&, std::string v) {
            return std::find(names.begin(), names.end(), v) != names.end()
                       ? std::string()
                       : "must be " + list + ", got \"" + v + "\"";
          }};
}

// ------------------------------------------------------------------ rows ---

struct Row {
  ScenarioKey info;  // default_value is filled from a default Scenario
  std::function<std::string(Scenario&, const json&)> decode;
  std::function<json(const Scenario&)> encode;
  std::function<std::string(const Scenario&)> check;  // "" when valid
};

// A row bound to one scalar field; `access` returns a reference to it.
template <class F>
Row field(const char* key, F access, const char* doc,
          std::vector<Rule<std::remove_reference_t<decltype(access(std::declval<Scenario&>()))>>>
              rules = {}) {
  using T = std::remove_reference_t<decltype(access(std::declval<Scenario&>()))>;
  Row r;
  r.info.key = key;
  r.info.type = type_name<T>();
  r.info.doc = doc;
  for (const auto& rule : rules)
    r.info.constraint += (r.info.constraint.empty() ? "" : "; ") + rule.text;
  r.decode = [access](Scenario& s, const json& v) { return decode_value(v, &access(s)); };
  r.encode = [access](const Scenario& s) {
    return encode_value(access(const_cast<Scenario&>(s)));
  };
  r.check = [access, rules](const Scenario& s) {
    T v = access(const_cast<Scenario&>(s));
    for (const auto& rule : rules)
      if (std::string e = rule.fails(s, v); !e.empty()) return e;
    return std::string();
  };
  return r;
}

// moe.policy: a string naming a MoePolicy.
Row policy_row() {
  Row r;
  r.info.key = "moe.policy";
  r.info.type = "string";
  r.info.doc = "Expert scheduling: rounds (fixed capacity per round, overflow waits, never drops), "
               "peak (one round sized to the busiest expert), drop (overflow skips the expert; "
               "changes the math).";
  r.info.constraint = "one of rounds, peak, drop";
  r.decode = [](Scenario& s, const json& v) -> std::string {
    std::string name;
    if (std::string e = decode_value(v, &name); !e.empty()) return e;
    if (name == "rounds") s.model.moe_policy = MoePolicy::kRounds;
    else if (name == "peak") s.model.moe_policy = MoePolicy::kPeak;
    else if (name == "drop") s.model.moe_policy = MoePolicy::kDrop;
    else return "must be one of rounds, peak, drop, got \"" + name + "\"";
    return std::string();
  };
  r.encode = [](const Scenario& s) {
    return json(s.model.moe_policy == MoePolicy::kRounds ? "rounds"
                : s.model.moe_policy == MoePolicy::kPeak ? "peak"
                                                         : "drop");
  };
  r.check = [](const Scenario&) { return std::string(); };
  return r;
}

const Row* find_row(const std::string& key);

// faults: a list of fault objects. fault_from_json checks each one alone;
// the checks against the rest of the scenario are here, naming faults[i].
std::string check_faults(const Scenario& s) {
  // In step order (list order within a step), so that each fault sees the
  // mesh.dp left by the shrink/grow faults before it.
  std::vector<size_t> order(s.faults.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return s.faults[a].step < s.faults[b].step; });
  int dp = s.mesh.dp;
  std::string dp_from = "mesh.dp = " + show(dp);
  // The scenario on a shrunk/grown mesh, made once without the fault list:
  // a copy per shrink/grow fault made a long list quadratic.
  std::unique_ptr<Scenario> next;
  for (size_t i : order) {
    const FaultSpec& f = s.faults[i];
    const std::string at = "faults[" + std::to_string(i) + "].";
    const std::string kind = fault_kind_name(f.kind);
    if (f.step > s.steps)
      return at + "step: must be <= train.steps = " + show(s.steps) + ", got " + show(f.step);
    const bool ckpt_phase = is_checkpoint_phase(f.phase);
    if (ckpt_phase || f.kind == FaultKind::kUploadCrash || f.kind == FaultKind::kBitrot ||
        f.kind == FaultKind::kStoreTransient || f.kind == FaultKind::kStoreDown) {
      if (s.ckpt.url.empty() || s.ckpt.every < 1)
        return at + (ckpt_phase ? "phase: " + std::string(fault_phase_name(f.phase)) : "kind: " + kind) +
               " needs checkpoints; set ckpt.url and ckpt.every >= 1";
      if (ckpt_phase && f.step % s.ckpt.every != 0)
        return at + "step: no checkpoint is saved after step " + show(f.step) + " (ckpt.every = " +
               show(s.ckpt.every) + "); a fault at phase " + fault_phase_name(f.phase) +
               " fires while its step's checkpoint is saved";
      if (f.kind == FaultKind::kBitrot && f.step % s.ckpt.every != 0)
        return at + "step: bitrot corrupts the checkpoint saved after its step, and none is saved after step " +
               show(f.step) + " (ckpt.every = " + show(s.ckpt.every) + "); use a multiple of ckpt.every";
      if (f.kind == FaultKind::kBitrot && f.step <= s.ckpt.every)
        return at + "step: must be > ckpt.every = " + show(s.ckpt.every) +
               " so that a checkpoint exists to corrupt, got " + show(f.step);
    }
    // Each rank (the world's) uploads one shard object per checkpoint, the manifest aside.
    const int ranks = dp * s.mesh.tp * s.mesh.pp * s.mesh.cp;
    const std::string ranks_from = dp_from + (s.mesh.tp > 1 ? " x mesh.tp = " + show(s.mesh.tp) : std::string()) +
                                   (s.mesh.pp > 1 ? " x mesh.pp = " + show(s.mesh.pp) : std::string()) +
                                   (s.mesh.cp > 1 ? " x mesh.cp = " + show(s.mesh.cp) : std::string());
    if (f.after_objects >= ranks)
      return at + "after_objects: a checkpoint uploads " + show(ranks) + " shard object" + (ranks == 1 ? "" : "s") +
             " (one per rank of " + ranks_from + "), so after_objects must be < " + show(ranks) + ", got " +
             show(f.after_objects);
    if ((f.kind == FaultKind::kRankCrash || f.kind == FaultKind::kStraggler) && f.rank >= ranks)
      return at + "rank: must be < " + ranks_from + ", got " + show(f.rank);
    if (f.kind == FaultKind::kShrink || f.kind == FaultKind::kGrow) {
      // (No direction check: after the restart, the child's mesh.dp already
      // is the new size while the fired fault is still listed.)
      // The new mesh must keep the bits, as mesh.dp itself must.
      if (!next) {
        Scenario base = s;
        base.faults.clear();
        next = std::make_unique<Scenario>(std::move(base));
      }
      next->mesh.dp = f.dp;
      if (std::string e = find_row("mesh.dp")->check(*next); !e.empty())
        return at + "dp: cannot restart on mesh.dp = " + show(f.dp) + ": " + e;
      dp = f.dp;
      dp_from = "mesh.dp = " + show(dp) + " (after " + kind + " at step " + show(f.step) + ")";
    }
  }
  return std::string();
}

Row faults_row() {
  Row r;
  r.info.key = "faults";
  r.info.type = "array";
  r.info.doc = "Faults to inject, each an object {\"kind\", \"step\", options} as in docs/FAULTS.md; "
               "not part of the fingerprint.";
  r.info.constraint = "step <= train.steps; rank < mesh.dp x mesh.tp x mesh.pp x mesh.cp; shrink/grow dp a valid mesh.dp; "
                      "checkpoint faults need ckpt.url and ckpt.every";
  r.decode = [](Scenario& s, const json& v) -> std::string {
    if (!v.is_array()) return "expected an array of fault objects, got " + describe(v);
    std::vector<FaultSpec> out;
    for (size_t i = 0; i < v.size(); ++i) {
      try {
        out.push_back(fault_from_json(v[i], "faults[" + std::to_string(i) + "]"));
      } catch (const UserError& e) {
        return e.what();  // "faults[i].field: ..."
      }
    }
    s.faults = std::move(out);
    return std::string();
  };
  r.encode = [](const Scenario& s) {
    json a = json::array();
    for (const FaultSpec& f : s.faults) a.push_back(fault_to_json(f));
    return a;
  };
  r.check = check_faults;
  return r;
}

std::vector<Row> make_rows() {
  using S = Scenario;
  std::vector<Row> t = {
      field("seed", [](S& s) -> uint64_t& { return s.seed; },
            "Key of every random draw (init, data order): the Philox seed.",
            {{"in [0, 2^64 - 1]", [](const S&, uint64_t) { return std::string(); }}}),
      field("name", [](S& s) -> std::string& { return s.name; },
            "Run name shown in reports and used for output names.",
            {{"empty: the file's stem", [](const S&, std::string) { return std::string(); }}}),
      field("description", [](S& s) -> std::string& { return s.description; },
            "Free text shown in reports."),

      field("model.d_model", [](S& s) -> int& { return s.model.d_model; },
            "Width of the residual stream.", {in_range(1, 4096)}),
      field("model.n_layers", [](S& s) -> int& { return s.model.n_layers; },
            "Transformer blocks (attention + MoE each).", {in_range(1, 64)}),
      field("model.n_heads", [](S& s) -> int& { return s.model.n_heads; },
            "Attention heads; head_dim = d_model / n_heads.",
            {at_least(1),
             {"divides model.d_model", [](const S& s, int v) {
                return s.model.d_model % v == 0
                           ? std::string()
                           : "must divide model.d_model = " + show(s.model.d_model) + ", got " +
                                 show(v);
              }}}),
      field("model.seq_len", [](S& s) -> int& { return s.model.seq_len; },
            "Tokens (bytes) per sample.", {in_range(1, 8192)}),
      field("model.d_ff", [](S& s) -> int& { return s.model.d_ff; },
            "Hidden width of each expert and of the shared expert.", {in_range(1, 16384)}),
      field("model.shared_expert", [](S& s) -> bool& { return s.model.shared_expert; },
            "Add a dense shared expert that every token passes through."),
      field("model.init_std", [](S& s) -> float& { return s.model.init_std; },
            "Standard deviation of the uniform weight init.", {above(0.0f)}),
      field("model.rms_eps", [](S& s) -> float& { return s.model.rms_eps; },
            "Epsilon inside RMSNorm.", {above(0.0f)}),

      field("moe.experts", [](S& s) -> int& { return s.model.experts; },
            "Routed experts per MoE layer.", {in_range(1, 256)}),
      field("moe.top_k", [](S& s) -> int& { return s.model.top_k; },
            "Experts each token is routed to.",
            {{"in [1, moe.experts]", [](const S& s, int v) {
                return v >= 1 && v <= s.model.experts
                           ? std::string()
                           : "must be in [1, moe.experts = " + show(s.model.experts) + "], got " +
                                 show(v);
              }}}),
      field("moe.aux_loss_weight", [](S& s) -> float& { return s.model.aux_loss_weight; },
            "Weight of the Switch load-balancing loss; 0 disables it.", {at_least(0.0f)}),
      field("moe.z_loss_weight", [](S& s) -> float& { return s.model.z_loss_weight; },
            "Weight of the router z-loss; 0 disables it.", {at_least(0.0f)}),

      field("train.steps", [](S& s) -> int& { return s.steps; },
            "Optimizer steps to run.", {at_least(1)}),
      field("train.batch", [](S& s) -> int& { return s.batch; },
            "Global batch in samples per step.",
            {at_least(1),
             {"multiple of numerics.leaf_samples", [](const S& s, int v) {
                // leaf_samples < 1 is reported by its own row, later.
                return s.leaf_samples < 1 || v % s.leaf_samples == 0
                           ? std::string()
                           : "must be a multiple of numerics.leaf_samples = " +
                                 show(s.leaf_samples) + ", got " + show(v);
              }}}),
      field("train.microbatches", [](S& s) -> int& { return s.microbatches; },
            "Microbatches a rank's samples (train.batch / mesh.dp) run as, one after another through the pipeline "
            "stages (mesh.pp); each must be a power-of-two number of whole leaves, so that its sums are nodes of the "
            "contract's tree and the bits do not depend on the count.",
            {in_range(1, 4096),
             {"cuts each rank's samples into power-of-two numbers of whole leaves", [](const S& s, int v) {
                if (v == 1) return std::string();
                const int per = s.batch / std::max(1, s.mesh.dp);
                if (per % v != 0)
                  return "must divide the samples per rank, train.batch / mesh.dp = " + show(per) + ", got " + show(v);
                const int each = per / v;
                if (s.leaf_samples < 1 || each % s.leaf_samples != 0)
                  return "gives microbatches of " + show(each) + " samples, not a whole number of leaves of "
                         "numerics.leaf_samples = " + show(s.leaf_samples);
                const int leaves = each / s.leaf_samples;
                if (leaves & (leaves - 1))
                  return "gives " + show(leaves) + " leaves per microbatch; each must hold a power-of-two number of "
                         "leaves (train.batch / mesh.dp / train.microbatches / numerics.leaf_samples)";
                if (s.mesh.sp && (leaves % s.mesh.tp != 0 || ((leaves / s.mesh.tp) & (leaves / s.mesh.tp - 1))))
                  return "gives " + show(leaves) + " leaves per microbatch over mesh.tp = " + show(s.mesh.tp) +
                         " sequence-parallel ranks; each must hold a power-of-two number of whole leaves";
                if (s.model.moe_policy == MoePolicy::kDrop)
                  return "is " + show(v) + " with moe.policy=drop, whose capacity counts the tokens one pass sees: "
                         "the microbatch count would change which rows are dropped";
                return std::string();
              }}}),
      field("train.lr", [](S& s) -> float& { return s.optim.lr; },
            "Peak learning rate.", {above(0.0f)}),
      field("train.min_lr_ratio", [](S& s) -> float& { return s.optim.min_lr_ratio; },
            "Cosine decay ends at lr * min_lr_ratio.", {in_range(0.0f, 1.0f)}),
      field("train.warmup_steps", [](S& s) -> int& { return s.optim.warmup_steps; },
            "Linear warmup from lr / warmup_steps up to lr.", {at_least(0)}),
      field("train.decay_steps", [](S& s) -> int& { return s.optim.decay_steps; },
            "Length of the cosine decay; 0 means train.steps.", {at_least(0)}),
      field("train.beta1", [](S& s) -> float& { return s.optim.beta1; },
            "AdamW first-moment decay.", {in_half_open(0.0f, 1.0f)}),
      field("train.beta2", [](S& s) -> float& { return s.optim.beta2; },
            "AdamW second-moment decay.", {in_half_open(0.0f, 1.0f)}),
      field("train.eps", [](S& s) -> float& { return s.optim.eps; },
            "AdamW epsilon.", {above(0.0f)}),
      field("train.weight_decay", [](S& s) -> float& { return s.optim.weight_decay; },
            "Decoupled weight decay, applied to matrices, not norms.", {at_least(0.0f)}),
      field("train.grad_clip", [](S& s) -> float& { return s.optim.grad_clip; },
            "Clip the global gradient L2 norm to this; 0 disables.", {at_least(0.0f)}),
      field("train.eval_every", [](S& s) -> int& { return s.eval_every; },
            "Evaluate validation BPB every N steps; 0 = only after the last step.",
            {at_least(0)}),
      field("train.eval_batches", [](S& s) -> int& { return s.eval_batches; },
            "Validation batches per evaluation (bounded: each is a full forward pass of train.batch).",
            {in_range(1, 4096)}),

      field("data.path", [](S& s) -> std::string& { return s.data.path; },
            "File of training bytes; empty = the built-in synthetic corpus."),
      field("data.synthetic_bytes", [](S& s) -> uint64_t& { return s.data.synthetic_bytes; },
            "Size of the synthetic corpus in bytes (used when data.path is empty).",
            {in_range<uint64_t>(4096, uint64_t{1} << 32)}),
      field("data.val_fraction", [](S& s) -> double& { return s.data.val_fraction; },
            "Tail fraction of the corpus held out for validation BPB.",
            {in_open_closed(0.0, 0.5)}),

      field("numerics.leaf_samples", [](S& s) -> int& { return s.leaf_samples; },
            "Samples per leaf of the token-reduction tree (a contract constant: "
            "changing it changes bits).",
            {at_least(1)}),
      field("numerics.level", [](S& s) -> std::string& { return s.level; },
            "portable: the numerics contract, the same bits on every mesh, thread count and backend; local: an "
            "ordinary fast trainer's numerics (Eigen GEMMs, the C library's exp, reductions in the fastest order), "
            "bitwise only run to run at a fixed thread count and mesh (docs/NUMERICS.md section 8).",
            {one_of({"portable", "local"})}),

      field("moe.router_skew", [](S& s) -> float& { return s.model.router_skew; },
            "A fixed bonus added to the router logits of the first max(1, experts/4) experts: "
            "skewed routing, for studying capacity and rounds. 0 = none.",
            {at_least(0.0f)}),
      policy_row(),
      field("moe.capacity_factor", [](S& s) -> float& { return s.model.capacity_factor; },
            "Expert slots per round = capacity_factor x mean load (tokens x top_k / experts).",
            {in_open_closed(0.0f, 1024.0f)}),
      field("moe.capacity", [](S& s) -> int& { return s.model.moe_capacity; },
            "Expert slots per round in tokens; 0 = use moe.capacity_factor.", {in_range(0, 1 << 24)}),
      field("moe.group_size", [](S& s) -> int& { return s.model.moe_group_size; },
            "Experts that lend each other unused slots (policy rounds with moe.borrow); 0 = all "
            "experts a rank holds.",
            {at_least(0),
             {"divides moe.experts / mesh.ep", [](const S& s, int v) {
                const int held = s.mesh.ep > 0 ? s.model.experts / s.mesh.ep : s.model.experts;
                if (v == 0 || (held > 0 && held % v == 0)) return std::string();
                return "must divide the experts a rank holds, moe.experts / mesh.ep = " + show(held) + ", got " +
                       show(v);
              }}}),
      field("moe.borrow", [](S& s) -> bool& { return s.model.moe_borrow; },
            "Let an overflowing expert use slots another expert of its group leaves empty."),

      field("mesh.dp", [](S& s) -> int& { return s.mesh.dp; },
            "Data-parallel ranks (the simulated world). Each holds train.batch / mesh.dp "
            "consecutive samples, which must be a power-of-two number of leaves so its partial "
            "sums are nodes of the contract's tree.",
            {in_range(1, 64),
             {"divides train.batch into a power-of-two number of leaves per rank",
              [](const S& s, int v) {
                if (v == 1) return std::string();  // one rank computes the whole tree
                if (s.batch % v != 0)
                  return "must divide train.batch = " + show(s.batch) + ", got " + show(v);
                const int per = s.batch / v;
                if (s.leaf_samples < 1 || per % s.leaf_samples != 0)
                  return "leaves train.batch / mesh.dp = " + show(per) +
                         " samples per rank, not a multiple of numerics.leaf_samples = " +
                         show(s.leaf_samples);
                const int leaves = per / s.leaf_samples;
                if (leaves & (leaves - 1))
                  return "gives " + show(leaves) +
                         " leaves per rank; the bits stay independent of the mesh only when "
                         "each rank holds a power-of-two number of leaves "
                         "(train.batch / mesh.dp / numerics.leaf_samples)";
                return std::string();
              }}}),
      field("mesh.ep", [](S& s) -> int& { return s.mesh.ep; },
            "Expert-parallel group size: experts are split over this many consecutive "
            "data-parallel ranks, tokens travel by all-to-all.",
            {in_range(1, 64),
             {"a power of two dividing mesh.dp and moe.experts", [](const S& s, int v) {
                if (v & (v - 1)) return "must be a power of two, got " + show(v);
                if (s.mesh.dp % v != 0)
                  return "must divide mesh.dp = " + show(s.mesh.dp) + ", got " + show(v);
                if (s.model.experts % v != 0)
                  return "must divide moe.experts = " + show(s.model.experts) + ", got " + show(v);
                return std::string();
              }}}),
      field("mesh.tp", [](S& s) -> int& { return s.mesh.tp; },
            "Tensor-parallel ranks per data-parallel rank (world = mesh.dp x mesh.tp): attention heads and "
            "the experts' hidden features are split across them; a fold over a split feature is chained "
            "from rank to rank in the contract's order (docs/NUMERICS.md), so the bits do not depend on it.",
            {in_range(1, 64),
             {"divides model.n_heads and model.d_ff", [](const S& s, int v) {
                if (s.model.n_heads % v != 0)
                  return "must divide model.n_heads = " + show(s.model.n_heads) + ", got " + show(v);
                if (s.model.d_ff % v != 0) return "must divide model.d_ff = " + show(s.model.d_ff) + ", got " + show(v);
                return std::string();
              }},
             {"not with numerics.level=local", [](const S& s, int v) {
                if (v == 1) return std::string();
                if (s.level == "local")
                  return "is " + show(v) + " with numerics.level=local: the chained fold needs the portable GEMM";
                return std::string();
              }}}),
      field("mesh.sp", [](S& s) -> bool& { return s.mesh.sp; },
            "Sequence parallel (with mesh.tp > 1): the norms, residual adds, router and head run on tokens split "
            "across the tensor-parallel ranks, gathered before the column-parallel GEMMs; the chained folds after "
            "the row-parallel ones land scattered.",
            {{"needs mesh.tp > 1 and a power-of-two number of leaves per tensor-parallel rank",
              [](const S& s, bool v) {
                if (!v) return std::string();
                if (s.mesh.tp < 2)
                  return std::string("is true but mesh.tp = 1: sequence parallel splits tokens across tensor-parallel "
                                     "ranks; set mesh.tp >= 2");
                const int per = s.batch / std::max(1, s.mesh.dp);
                const int leaves = s.leaf_samples > 0 ? per / s.leaf_samples : 0;
                if (leaves % s.mesh.tp != 0 || ((leaves / s.mesh.tp) & (leaves / s.mesh.tp - 1)))
                  return "gives " + show(leaves) + " leaves per data-parallel rank over mesh.tp = " + show(s.mesh.tp) +
                         " ranks; each tensor-parallel rank must hold a power-of-two number of whole leaves "
                         "(train.batch / mesh.dp / numerics.leaf_samples / mesh.tp)";
                return std::string();
              }}}),
      field("mesh.pp", [](S& s) -> int& { return s.mesh.pp; },
            "Pipeline stages (world = mesh.dp x mesh.tp x mesh.pp): each holds a contiguous range of the model's "
            "blocks, cut where only the residual stream crosses; activations go forward and gradients back, "
            "train.microbatches at a time.",
            {in_range(1, 64),
             {"at most the model's pipeline units", [](const S& s, int v) {
                const int units = 2 * s.model.n_layers + 2;  // embedding, per layer attention and MoE, head
                const int chunks = v * std::max(1, s.mesh.pp_virtual);
                if (chunks <= units) return std::string();
                return "is " + show(v) + (s.mesh.pp_virtual > 1 ? " (x mesh.pp_virtual = " + show(s.mesh.pp_virtual) +
                                                                      " chunks each)"
                                                                : std::string()) +
                       ": more stages than the model has blocks to give them; a model of " +
                       show(s.model.n_layers) + " layers cuts into at most " + show(units) +
                       " (the embedding, each layer's attention and MoE, the head)";
              }}}),
      field("mesh.pp_schedule", [](S& s) -> std::string& { return s.mesh.pp_schedule; },
            "The order a stage runs its microbatches' forward and backward passes in: gpipe (every forward, then "
            "every backward), 1f1b (one forward, one backward once the pipeline is full) or interleaved (1F1B over "
            "mesh.pp_virtual model chunks per stage). It changes only when work runs, never the bits.",
            {one_of({"gpipe", "1f1b", "interleaved"})}),
      field("mesh.pp_virtual", [](S& s) -> int& { return s.mesh.pp_virtual; },
            "With mesh.pp_schedule=interleaved: model chunks per stage (stage s holds chunks s, s + mesh.pp, ...).",
            {in_range(1, 64),
             {"1 unless interleaved; interleaved needs train.microbatches a multiple of mesh.pp",
              [](const S& s, int v) {
                if (s.mesh.pp_schedule != "interleaved")
                  return v == 1 ? std::string()
                                : "is " + show(v) + " but mesh.pp_schedule = " + s.mesh.pp_schedule +
                                      ": model chunks per stage need mesh.pp_schedule=interleaved";
                if (s.microbatches % std::max(1, s.mesh.pp) != 0)
                  return "interleaved runs microbatches in groups of mesh.pp = " + show(s.mesh.pp) +
                         "; train.microbatches = " + show(s.microbatches) + " is not a multiple";
                return std::string();
              }}}),
      field("mesh.cp", [](S& s) -> int& { return s.mesh.cp; },
            "Context-parallel ranks per data-parallel rank (world = mesh.dp x mesh.tp x mesh.pp x mesh.cp): "
            "each runs the attention block (QKV, attention, output projection) for its share of every "
            "sample's positions (mesh.cp_layout), K and V all-gathered, the dK and dV folds passed from rank "
            "to rank in ascending query order; the routed experts split by expert, the shared expert by "
            "position; the norms, router and head run on every rank of the group.",
            {in_range(1, 64),
             {"divides model.seq_len into equal shares (2 x mesh.cp chunks under zigzag)", [](const S& s, int v) {
                if (v == 1) return std::string();
                const int chunks = s.mesh.cp_layout == "zigzag" ? 2 * v : v;
                if (s.model.seq_len % chunks != 0)
                  return "is " + show(v) + ": model.seq_len = " + show(s.model.seq_len) + " does not cut into " +
                         show(chunks) + " equal chunks" +
                         (s.mesh.cp_layout == "zigzag" ? " (mesh.cp_layout=zigzag gives each rank two)" : "");
                return std::string();
              }},
             {"not with numerics.level=local", [](const S& s, int v) {
                if (v == 1 || s.level != "local") return std::string();
                return "is " + show(v) + " with numerics.level=local: the chained dK/dV fold needs the portable "
                       "attention kernels";
              }}}),
      field("mesh.cp_layout", [](S& s) -> std::string& { return s.mesh.cp_layout; },
            "Which query positions a context-parallel rank holds: zigzag (the sequence cut into 2 x mesh.cp "
            "chunks, rank c holding chunks c and 2 x mesh.cp - 1 - c, so every rank gets the same causal work) "
            "or contiguous (rank c holds chunk c of mesh.cp: the last rank does the most). Never changes the bits.",
            {one_of({"zigzag", "contiguous"})}),
      // One of the two alone saves nothing, silently: refused, naming both.
      field("ckpt.url", [](S& s) -> std::string& { return s.ckpt.url; },
            "Where checkpoints go: file://DIR (or a plain path) or s3://bucket/prefix; empty = none.",
            {{"set together with ckpt.every", [](const S& s, std::string v) {
                return v.empty() || s.ckpt.every != 0
                           ? std::string()
                           : "is set but ckpt.every is 0, so no checkpoint would be saved; set ckpt.every >= 1 "
                             "as well, or leave both ckpt.url and ckpt.every out";
              }}}),
      field("ckpt.every", [](S& s) -> int& { return s.ckpt.every; },
            "Save a checkpoint after every N steps; 0 = never.",
            {at_least(0),
             {"set together with ckpt.url", [](const S& s, int v) {
                return v == 0 || !s.ckpt.url.empty()
                           ? std::string()
                           : "is " + show(v) + " but ckpt.url is empty, so no checkpoint would be saved; set ckpt.url "
                             "as well, or leave both ckpt.url and ckpt.every out";
              }}}),
      field("ckpt.async", [](S& s) -> bool& { return s.ckpt.async; },
            "Upload in the background: only the copy to DRAM staging blocks training."),
      field("ckpt.keep_last", [](S& s) -> int& { return s.ckpt.keep_last; },
            "Committed checkpoints to keep; older ones are deleted after a newer one commits (0 = keep all).",
            {at_least(0)}),
      field("ckpt.max_inflight", [](S& s) -> int& { return s.ckpt.max_inflight; },
            "Checkpoints uploading at once; a save waits (back-pressure) beyond this.", {at_least(1)}),
      field("ckpt.restore", [](S& s) -> std::string& { return s.ckpt.restore; },
            "broadcast: every object read once by one rank and broadcast; naive: each rank reads what it needs.",
            {one_of({"broadcast", "naive"})}),
      field("ckpt.s3_endpoint", [](S& s) -> std::string& { return s.ckpt.s3_endpoint; },
            "S3 endpoint for s3:// URLs (e.g. http://127.0.0.1:4569); empty = env LOCKSTEP_S3_ENDPOINT."),
      field("ckpt.retry_seconds", [](S& s) -> double& { return s.ckpt.retry_seconds; },
            "A save's store call retries transient errors (an outage, a gateway restart) this long, with "
            "exponential backoff and jitter, before the save fails.",
            {in_range(0.0, 86400.0)}),
      field("ckpt.on_failure", [](S& s) -> std::string& { return s.ckpt.on_failure; },
            "continue: a save that fails past ckpt.retry_seconds is reported and training goes on (the next save "
            "tries again); stop: the run stops with exit 3.",
            {one_of({"continue", "stop"})}),
      field("ckpt.lease_seconds", [](S& s) -> double& { return s.ckpt.lease_seconds; },
            "A job holds its ckpt.url through a lease renewed every third of this; a job that dies without "
            "releasing it blocks the prefix this long (docs/CHECKPOINTS.md).",
            {in_range(1.0, 86400.0)}),
      field("mesh.fsdp", [](S& s) -> bool& { return s.mesh.fsdp; },
            "Shard parameters, gradients and AdamW state across data-parallel ranks "
            "(all-gather before use, reduce-scatter of gradients)."),
      field("mesh.replicate", [](S& s) -> int& { return s.mesh.replicate; },
            "With mesh.fsdp: replica groups (HSDP); each shards over mesh.dp / mesh.replicate "
            "consecutive ranks and replicas all-reduce.",
            {at_least(1),
             {"divides mesh.dp", [](const S& s, int v) {
                return s.mesh.dp % v == 0 ? std::string()
                                          : "must divide mesh.dp = " + show(s.mesh.dp) + ", got " + show(v);
              }}}),
      faults_row(),  // last: its checks rely on train.*, mesh.* and ckpt.* being valid
  };
  const Scenario defaults;
  for (Row& r : t) r.info.default_value = r.encode(defaults);
  return t;
}

const std::vector<Row>& rows() {
  static const std::vector<Row> t = make_rows();
  return t;
}

const Row* find_row(const std::string& key) {
  for (const Row& r : rows())
    if (r.info.key == key) return &r;
  return nullptr;
}

// Sections are the proper dotted prefixes of keys: "model", "moe", ...
const std::vector<std::string>& sections() {
  static const std::vector<std::string> t = [] {
    std::vector<std::string> out;
    for (const Row& r : rows())
      for (size_t p = r.info.key.find('.'); p != std::string::npos;
           p = r.info.key.find('.', p + 1)) {
        std::string s = r.info.key.substr(0, p);
        if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
      }
    return out;
  }();
  return t;
}

bool is_section(const std::string& key) {
  const auto& s = sections();
  return std::find(s.begin(), s.end(), key) != s.end();
}

// ---------------------------------------------------------- unknown keys ---


// "unknown key 'moe.topk' (did you mean 'moe.top_k'?)"; without a close
// match, lists the keys of the enclosing section instead.
std::string unknown_key(const std::string& key) {
  // The edit distance costs key length x candidate length per candidate.
  constexpr size_t kLongestSuggested = 128;
  if (key.size() > kLongestSuggested)
    return "unknown key '" + quote_for_message(key) + "' (" + std::to_string(key.size()) +
           " bytes; no key is that long)";
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  auto consider = [&](const std::string& c) {
    size_t d = edit_distance(key, c);
    if (d < best_d) best_d = d, best = c;  // ties: first in table order
  };
  for (const Row& r : rows()) consider(r.info.key);
  for (const std::string& s : sections()) consider(s);
  std::string msg = "unknown key '" + key + "'";
  // Short keys tolerate one edit ('foo' is not a typo of 'moe'), longer ones more.
  const size_t limit = key.size() <= 5 ? 1 : key.size() <= 12 ? 2 : 3;
  if (best_d <= limit) return msg + " (did you mean '" + best + "'?)";

  // Otherwise list the keys of the deepest known section above `key`.
  std::string parent = key;
  do {
    size_t dot = parent.rfind('.');
    parent = dot == std::string::npos ? "" : parent.substr(0, dot);
  } while (!parent.empty() && !is_section(parent));
  std::string note;
  if (parent.empty() && key.find('.') != std::string::npos)
    note = "no section '" + key.substr(0, key.find('.')) + "'; ";
  std::vector<std::string> names;
  for (const Row& r : rows()) {
    const std::string& k = r.info.key;
    std::string rest;
    if (parent.empty()) rest = k;
    else if (k.compare(0, parent.size() + 1, parent + ".") == 0) rest = k.substr(parent.size() + 1);
    else continue;
    rest = rest.substr(0, rest.find('.'));
    if (std::find(names.begin(), names.end(), rest) == names.end()) names.push_back(rest);
  }
  if (names.empty()) return msg;
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
  return msg + " (" + note + (parent.empty() ? "top-level keys" : "keys in '" + parent + "'") +
         ": " + list + ")";
}

// ---------------------------------------------------------------- loading ---

struct Loader {
  std::string origin;
  std::map<std::string, std::string> set_text;  // key -> "--set key=value" that set it

  std::string where(const std::string& key) const {
    auto it = set_text.find(key);
    return it != set_text.end() ? it->second : origin;
  }
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const {
    // A list row's message names the element itself: "faults[2].phase: ...".
    if (msg.compare(0, key.size() + 1, key + "[") == 0) throw UserError(where(key) + ": " + msg);
    throw UserError(where(key) + ": " + key + ": " + msg);
  }

  // Puts one override into the document, creating sections as needed.
  void apply_set(json& doc, const std::string& set) {
    if (!valid_utf8(set)) throw UserError("--set '" + quote_for_message(set) + "': not valid UTF-8");
    size_t eq = set.find('=');
    if (eq == std::string::npos || eq == 0)
      throw UserError("--set '" + quote_for_message(set) + "': expected dotted.key=value");
    const std::string key = set.substr(0, eq), raw = set.substr(eq + 1);
    const std::string who = "--set " + quote_for_message(set, 200);
    const Row* row = find_row(key);
    if (!row) {
      if (is_section(key)) {
        std::string example;
        for (const Row& r : rows())
          if (example.empty() && r.info.key.compare(0, key.size() + 1, key + ".") == 0)
            example = r.info.key;
        throw UserError(who + ": '" + key + "' is a section; set one of its keys, e.g. '" +
                        example + "'");
      }
      throw UserError(who + ": " + unknown_key(key));
    }
    if (json_depth_violation(raw, kMaxJsonDepth, false) != std::string::npos)
      throw UserError(who + ": JSON value nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    json value;
    try {
      value = json::parse(raw);
    } catch (const json::parse_error&) {
      value = raw;  // not JSON: a bare string
    } catch (const json::exception&) {
      // A number beyond binary64 (1e400): not a bare string either.
      throw UserError(who + ": number out of range");
    }
    // For a string key the text is the value (name=123 means "123") unless
    // it was written as a quoted JSON string.
    if (row->info.type == "string" && !value.is_string()) value = raw;

    json* node = &doc;
    size_t start = 0;
    for (size_t dot = key.find('.'); dot != std::string::npos; dot = key.find('.', start)) {
      const std::string part = key.substr(start, dot - start), path = key.substr(0, dot);
      json& child = (*node)[part];
      if (child.is_null()) child = json::object();
      if (!child.is_object())
        throw UserError(origin + ": " + path + ": expected object, got " + describe(child));
      node = &child;
      start = dot + 1;
    }
    (*node)[key.substr(start)] = std::move(value);
    set_text[key] = who;
  }

  // Decodes every member of a section object into `s`.
  void walk(const json& obj, const std::string& prefix, Scenario& s) const {
    for (const auto& item : obj.items()) {
      const std::string& k = item.key();
      const std::string full = prefix.empty() ? k : prefix + "." + k;
      if (k.find('.') != std::string::npos)
        throw UserError(origin + ": key '" + quote_for_message(full) + "' contains '.'; nest it as an object " +
                        "(e.g. {\"model\": {\"d_model\": 64}})");
      if (const Row* row = find_row(full)) {
        if (std::string e = row->decode(s, item.value()); !e.empty()) fail(full, e);
      } else if (is_section(full)) {
        if (!item.value().is_object())
          fail(full, "expected object (a section), got " + describe(item.value()));
        walk(item.value(), full, s);
      } else {
        throw UserError(where(full) + ": " + unknown_key(full));
      }
    }
  }

  Scenario load(const json& file, const std::vector<std::string>& sets) {
    if (!file.is_object())
      throw UserError(origin + ": expected a JSON object at top level, got " + describe(file));
    json doc = file;
    for (const std::string& set : sets) apply_set(doc, set);

    Scenario s;
    walk(doc, "", s);
    if (s.name.empty()) s.name = std::filesystem::path(origin).stem().string();
    for (const Row& r : rows())
      if (std::string e = r.check(s); !e.empty()) fail(r.info.key, e);

    s.resolved = json::object();
    for (const Row& r : rows()) {
      std::string ptr = "/" + r.info.key;
      std::replace(ptr.begin(), ptr.end(), '.', '/');
      s.resolved[json::json_pointer(ptr)] = r.encode(s);
    }
    return s;
  }
};

}  // namespace

std::vector<FaultSpec> planned_faults(const Scenario& s, const std::vector<std::string>& specs, int steps) {
  Scenario all = s;
  for (const std::string& t : specs) all.faults.push_back(parse_fault(t));
  if (steps > 0) all.steps = steps;
  if (std::string e = check_faults(all); !e.empty()) {
    // "faults[i].step: ..." -> the scenario's entry, or the --fault that gave it.
    const size_t i = std::stoul(e.substr(7));
    const std::string rest = e.substr(e.find("]") + 2);
    const std::string steps_note = steps > 0 ? " (--steps " + std::to_string(steps) + " sets train.steps)" : "";
    if (i >= s.faults.size())
      throw UserError("--fault " + quote_for_message(specs[i - s.faults.size()], 120) + ": can never fire: " + rest +
                      steps_note);
    throw UserError(s.name + ": faults[" + std::to_string(i) + "]." + rest + steps_note);
  }
  return all.faults;
}

const std::vector<ScenarioKey>& scenario_keys() {
  static const std::vector<ScenarioKey> t = [] {
    std::vector<ScenarioKey> out;
    for (const Row& r : rows()) out.push_back(r.info);
    return out;
  }();
  return t;
}

std::string scenario_keys_markdown() {
  std::string md = "| key | type | default | meaning | constraints |\n"
                   "| --- | --- | --- | --- | --- |\n";
  for (const ScenarioKey& k : scenario_keys())
    md += "| `" + k.key + "` | " + k.type + " | `" + k.default_value.dump() + "` | " + k.doc +
          " | " + k.constraint + " |\n";
  return md;
}

Scenario scenario_from_json(const nlohmann::json& j, const std::string& origin,
                            const std::vector<std::string>& sets) {
  Loader l;
  l.origin = origin;
  return l.load(j, sets);
}

Scenario load_scenario(const std::string& path, const std::vector<std::string>& sets) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) throw UserError(path + ": scenario file not found");
  if (fs::is_directory(st)) throw UserError(path + ": is a directory, not a scenario file");
  const std::string text = read_file_limited(path, kMaxScenarioBytes);

  // Comments (// and /* */) are allowed: scenarios are written by hand.
  JsonInputOptions jo;
  jo.allow_comments = true;
  jo.max_bytes = kMaxScenarioBytes;
  jo.reject_duplicate_keys = true;
  return scenario_from_json(parse_untrusted_json(text, path, jo), path, sets);
}

bool is_numerics_key(const std::string& k) {
  return !(k == "name" || k == "description" || k.rfind("mesh.", 0) == 0 || k.rfind("ckpt.", 0) == 0 ||
           k == "train.microbatches" ||
           k == "faults" || k == "moe.capacity_factor" || k == "moe.capacity" || k == "moe.group_size" ||
           k == "moe.borrow");
}

std::vector<std::string> numerics_differences(const nlohmann::json& a, const nlohmann::json& b) {
  std::vector<std::string> out;
  for (const Row& r : rows()) {
    const std::string& k = r.info.key;
    if (!is_numerics_key(k)) continue;
    std::string ptr = "/" + k;
    std::replace(ptr.begin(), ptr.end(), '.', '/');
    const json::json_pointer p(ptr);
    const json va = a.contains(p) ? a.at(p) : r.info.default_value, vb = b.contains(p) ? b.at(p) : r.info.default_value;
    if (va != vb) out.push_back(k + " " + va.dump() + " -> " + vb.dump());
  }
  return out;
}

std::string scenario_fingerprint(const Scenario& s, const std::string& data_digest) {
  // The numerics: every key except names and the keys that only decide how
  // the work is decomposed (mesh, MoE capacity schedule), which must not
  // change one bit. A run on any mesh shares its single-rank twin's golden.
  // Keys at their default are left out too, so adding a key (with a default
  // that keeps the old behaviour) leaves every existing fingerprint alone.
  json j = json::object();
  for (const Row& r : rows()) {
    const std::string& k = r.info.key;
    if (!is_numerics_key(k)) continue;
    const json v = r.encode(s);
    if (k == "moe.policy" && v != "drop") continue;
    if (v == r.info.default_value) continue;
    j[k] = v;
  }
  if (!s.data.path.empty() && !data_digest.empty()) j["data.path.content_xxh128"] = data_digest;
  const std::string d = j.dump();
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(d.data(), d.size()));
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : c.digest) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

}  // namespace ls
