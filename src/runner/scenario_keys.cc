// The key table: every scenario key's row, in table order, one function per
// section. Adding a key means adding its row to its section here (and the
// docs: docs/SCENARIOS.md embeds scenario_keys_markdown()); a list-valued key
// such as `faults` needs a row with its own decode/encode functions.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "runner/scenario.h"
#include "runner/scenario_field.h"
#include "runner/scenario_table.h"

namespace ls {
namespace scenario_table {

double float_for_json(float f) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf - 1, f);
  *r.ptr = '\0';
  double d = std::strtod(buf, nullptr);
  return static_cast<float>(d) == f ? d : static_cast<double>(f);
}

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

namespace {

using S = Scenario;

// A string key naming one of a ModelConfig enum's values.
template <class E>
Row enum_row(const std::string& key, const std::string& doc, E ModelConfig::*member,
             std::vector<std::pair<std::string, E>> values) {
  std::string list;
  for (const auto& [name, value] : values) list += (list.empty() ? "" : ", ") + name;
  Row r;
  r.info.key = key;
  r.info.type = "string";
  r.info.doc = doc;
  r.info.constraint = "one of " + list;
  r.decode = [member, values, list](Scenario& s, const json& v) -> std::string {
    std::string name;
    if (std::string e = decode_value(v, &name); !e.empty()) return e;
    for (const auto& [n, value] : values)
      if (n == name) {
        s.model.*member = value;
        return std::string();
      }
    return "must be one of " + list + ", got \"" + name + "\"";
  };
  r.encode = [member, values](const Scenario& s) {
    for (const auto& [n, value] : values)
      if (s.model.*member == value) return json(n);
    return json(nullptr);
  };
  r.check = [](const Scenario&) { return std::string(); };
  return r;
}

Row policy_row() {
  return enum_row<MoePolicy>("moe.policy",
                             "Expert scheduling: rounds (fixed capacity per round, overflow waits, never drops), "
                             "peak (one round sized to the busiest expert), drop (overflow skips the expert; "
                             "changes the math).",
                             &ModelConfig::moe_policy,
                             {{"rounds", MoePolicy::kRounds}, {"peak", MoePolicy::kPeak}, {"drop", MoePolicy::kDrop}});
}

Row aux_scope_row() {
  return enum_row<AuxScope>(
      "moe.aux_scope",
      "Tokens the load-balancing loss counts over: batch (each expert's share of the step's assignments and of its "
      "gates, over the whole global batch: Switch) or sequence (each sample's own, the samples' losses averaged: "
      "DeepSeek-V3's sequence-wise balance loss). With sequence a microbatch knows its counts when its forward "
      "ends, so a 1F1B pipeline holds no backward.",
      &ModelConfig::aux_scope, {{"batch", AuxScope::kBatch}, {"sequence", AuxScope::kSequence}});
}

// The run's identity and its random draws.
std::vector<Row> top_level_rows() {
  return {
      field("seed", [](S& s) -> uint64_t& { return s.seed; },
            "Key of every random draw (init, data order): the Philox seed.",
            {{"in [0, 2^64 - 1]", [](const S&, uint64_t) { return std::string(); }}}),
      field("name", [](S& s) -> std::string& { return s.name; },
            "Run name shown in reports and used for output names.",
            {{"empty: the file's stem", [](const S&, std::string) { return std::string(); }}}),
      field("description", [](S& s) -> std::string& { return s.description; },
            "Free text shown in reports."),
  };
}

// The transformer's shape.
std::vector<Row> model_rows() {
  return {
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
  };
}

// The MoE layers' experts and their losses.
std::vector<Row> moe_rows() {
  return {
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
      aux_scope_row(),
  };
}

// Steps and batches.
std::vector<Row> train_rows() {
  return {
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
  };
}

// AdamW and its learning-rate schedule (OptimConfig).
std::vector<Row> optim_rows() {
  return {
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
  };
}

// Held-out evaluation.
std::vector<Row> eval_rows() {
  return {
      field("train.eval_every", [](S& s) -> int& { return s.eval_every; },
            "Evaluate validation BPB every N steps; 0 = only after the last step.",
            {at_least(0)}),
      field("train.eval_batches", [](S& s) -> int& { return s.eval_batches; },
            "Validation batches per evaluation (bounded: each is a full forward pass of train.batch).",
            {in_range(1, 4096)}),
  };
}

// The corpus.
std::vector<Row> data_rows() {
  return {
      field("data.path", [](S& s) -> std::string& { return s.data.path; },
            "File of training bytes (a gzip file is read decompressed); empty = the built-in "
            "synthetic corpus."),
      field("data.synthetic_bytes", [](S& s) -> uint64_t& { return s.data.synthetic_bytes; },
            "Size of the synthetic corpus in bytes (used when data.path is empty).",
            {in_range<uint64_t>(4096, uint64_t{1} << 32)}),
      field("data.val_fraction", [](S& s) -> double& { return s.data.val_fraction; },
            "Tail fraction of the corpus held out for validation BPB.",
            {in_open_closed(0.0, 0.5)}),
  };
}

// At bf16 a feature fold that continues from an earlier part (a rank's
// slice of a chained fold, the q, k and v parts of QKV's input gradient, an
// expert's v half after its u half) equals one fold only when every earlier
// part is a whole number of the fold's blocks (docs/NUMERICS.md §10).
constexpr int kBf16PartMultiple = 32;

Rule<std::string> bf16_fold_parts() {
  return {"fold parts a multiple of 32 wide at bf16", [](const S& s, std::string v) -> std::string {
            if (v != "bf16") return "";
            const ModelConfig& m = s.model;
            const int tp = std::max(1, s.mesh.tp), etp = std::max(1, s.mesh.expert_tp()), q = kBf16PartMultiple;
            const std::string need = "needs fold parts a multiple of " + show(q) + " wide at bf16: ";
            if (m.d_model % (tp * q) != 0)
              return need + "model.d_model / mesh.tp = " + show(m.d_model) + " / " + show(tp);
            if (m.d_ff % (etp * q) != 0) return need + "model.d_ff / mesh.etp = " + show(m.d_ff) + " / " + show(etp);
            if (m.shared_expert && m.d_ff % (tp * q) != 0)
              return need + "model.d_ff / mesh.tp (the shared expert) = " + show(m.d_ff) + " / " + show(tp);
            return "";
          }};
}

// The numerics contract's constants and level.
std::vector<Row> numerics_rows() {
  return {
      field("numerics.leaf_samples", [](S& s) -> int& { return s.leaf_samples; },
            "Samples per leaf of the token-reduction tree (a contract constant: "
            "changing it changes bits).",
            {at_least(1)}),
      field("numerics.level", [](S& s) -> std::string& { return s.level; },
            "portable: the numerics contract, the same bits on every mesh, thread count and backend; local: an "
            "ordinary fast trainer's numerics (OpenBLAS sgemm, or Eigen in a build without OpenBLAS; at "
            "numerics.precision=bf16 oneDNN's bf16 matmul; the C library's exp; reductions in fixed orders that are not the contract's, e.g. the ranks' partials added "
            "left to right): the same bits run to run at a fixed thread count and mesh, in one process or under "
            "--launcher mpi; another thread count or mesh may change them (docs/NUMERICS.md section 8).",
            {one_of({"portable", "local"})}),
      field("numerics.precision", [](S& s) -> std::string& { return s.precision; },
            "fp32: every matrix product in binary32; bf16: mixed precision as Megatron's --bf16 runs it, the "
            "operands of the model's matrix products (weights, activations and their gradients) rounded to bf16 "
            "and their products summed in fp32, the router, norms, softmax, attention scores, loss, optimizer and "
            "every cross-rank reduction in fp32 (docs/NUMERICS.md section 10).",
            {one_of({"fp32", "bf16"}), bf16_fold_parts()}),
  };
}

// Routing skew and how experts' rows are scheduled.
std::vector<Row> moe_schedule_rows() {
  return {
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
  };
}

// Checkpoints: where, how often, how they upload and restore.
std::vector<Row> ckpt_rows() {
  return {
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
  };
}

// The sections' rows in table order: the docs' order, and the order the
// loader checks them in (the first that fails is reported).
std::vector<Row> make_rows() {
  std::vector<Row> t;
  for (std::vector<Row> (*section)() :
       {top_level_rows, model_rows, moe_rows, train_rows, optim_rows, eval_rows, data_rows, numerics_rows,
        moe_schedule_rows, data_parallel_rows, tensor_parallel_rows, pipeline_rows, context_parallel_rows, ckpt_rows,
        fsdp_rows})
    for (Row& r : section()) t.push_back(std::move(r));
  t.push_back(faults_row());  // last: its checks rely on train.*, mesh.* and ckpt.* being valid
  const Scenario defaults;
  for (Row& r : t) r.info.default_value = r.encode(defaults);
  return t;
}

}  // namespace

const std::vector<Row>& rows() {
  static const std::vector<Row> t = make_rows();
  return t;
}

const Row* find_row(const std::string& key) {
  for (const Row& r : rows())
    if (r.info.key == key) return &r;
  return nullptr;
}

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

}  // namespace scenario_table
}  // namespace ls
