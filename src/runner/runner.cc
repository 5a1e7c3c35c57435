#include "runner/memory_plan.h"
#include "runner/runner.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "common/error.h"
#include "common/numerics_level.h"
#include "common/op_profile.h"
#include "ops/local.h"
#include "contract.h"
#include "data/corpus.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "reference.h"
#include "runner/cluster_trainer.h"
#include "runner/execution_target.h"
#include "runner/data_lanes.h"
#include "ckpt/checkpointer.h"
#include "ckpt/lease.h"
#include "common/json_input.h"
#include "runner/lifeline.h"
#include "faults/injector.h"
#include "store/store.h"

namespace ls {

Backend parse_backend(const std::string& name) {
  if (name == "engine") return Backend::kEngine;
  if (name == "reference") return Backend::kReference;
  if (name == "cuda-emulated") return Backend::kCudaEmulated;
  if (name == "cuda") return Backend::kCuda;
  throw UserError("--backend: unknown backend '" + name + "' (expected engine, reference, cuda-emulated or cuda)");
}
const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kEngine: return "engine";
    case Backend::kReference: return "reference";
    case Backend::kCudaEmulated: return "cuda-emulated";
    case Backend::kCuda: return "cuda";
  }
  return "?";
}

namespace {

class EngineTrainer : public Trainer {
 public:
  explicit EngineTrainer(const Scenario& s)
      : model_(s.model, s.leaf_samples, s.seed), opt_(s.optim, s.steps, model_.params()),
        leaf_samples_(s.leaf_samples) {}
  float train_step(const uint8_t* tokens, int batch, int step, float* grad_norm) override {
    // With several threads, whole lanes of samples side by side when that
    // keeps the bits (runner/data_lanes.h); else every op split over threads.
    // Traced and hooked steps run as one model: sinks and hooks see one rank.
    const int threads = omp_get_max_threads();
    StepLosses l;
    if (!traced_ && !phase_hook_ &&
        DataLanes::applicable(model_.config(), leaf_samples_, model_.num_weights(), batch, threads)) {
      if (!lanes_ || lanes_->lanes() != threads) lanes_ = std::make_unique<DataLanes>(model_, threads);
      l = lanes_->forward_backward(model_, tokens, batch);
    } else {
      l = model_.forward_backward(tokens, batch);
    }
    if (phase_hook_) phase_hook_("optimizer", 0);
    *grad_norm = opt_.step(step, model_.weights(), model_.grads());
    return l.ce;
  }
  void set_phase_hook(std::function<void(const char*, int)> hook) override {
    phase_hook_ = hook;
    if (hook) model_.set_phase_hook([hook](const char* phase) { hook(phase, 0); });
    else model_.set_phase_hook(nullptr);
  }
  float eval_loss(const uint8_t* tokens, int batch) override { return model_.forward(tokens, batch).ce; }
  std::string state_hash() const override {
    StateHasher hs;  // names: adam_m/<p>, adam_v/<p>, param/<p> in bytewise order
    for (const char* kind : {"adam_m/", "adam_v/", "param/"})
      for (const ParamInfo& p : model_.params()) {
        const float* base = kind[0] == 'p' ? model_.weights() : kind[5] == 'm' ? opt_.m().data() : opt_.v().data();
        hs.add(kind + p.name, p.shape, base + p.offset);
      }
    return hs.hex();
  }
  double train_flops_per_token() const override { return model_.train_flops_per_token(); }
  std::vector<int64_t> tokens_per_expert() const override { return model_.moe_stats().tokens_per_expert; }
  MeshReport mesh_report() const override {
    const MoeStats& st = model_.moe_stats();
    MeshReport m;
    m.add(st);
    return m;
  }
  void set_trace(TraceSink* sink) override {
    model_.set_trace(sink);
    traced_ = sink != nullptr;
  }
  void debug_bump_weight(const std::string& param, int64_t index) override {
    bool known = false;
    for (const ParamInfo& q : model_.params()) known = known || q.name == param;
    if (!known) throw UserError("--debug-bump: no parameter '" + param + "'");
    const ParamInfo& p = model_.param(param);
    if (index < 0 || index >= p.size) throw UserError("--debug-bump: index out of range for " + param);
    float& w = model_.weights()[p.offset + index];
    w = from_bits(bits(w) + (w >= 0 ? 1 : -1));
  }
  void set_debug_reorder_moe_norm(bool on) override { model_.set_debug_reorder_moe_norm(on); }

  void stage_state(std::vector<std::vector<StatePiece>>& out) override {
    std::vector<StatePiece> needs = state_needs(0);
    out.resize(1);
    out[0].resize(needs.size());
    for (size_t i = 0; i < needs.size(); ++i) {
      ops::StagingVector<float> buffer = std::move(out[0][i].data);  // reused capacity
      out[0][i] = std::move(needs[i]);
      buffer.resize(out[0][i].global_end - out[0][i].global_begin);
      ops::copy_to_host(buffer.data(), source(out[0][i]), buffer.size() * sizeof(float));  // device -> staging
      out[0][i].data = std::move(buffer);
    }
  }
  std::vector<StatePiece> state_needs(int) const override {
    std::vector<StatePiece> out;
    for (const char* kind : {"param/", "adam_m/", "adam_v/"})
      for (const ParamInfo& p : model_.params()) out.push_back({kind + p.name, p.global_shape, 0, p.size, {}});
    return out;
  }
  void load_piece(int, const StatePiece& need, const float* data) override {
    float* dst = const_cast<float*>(source(need));
    std::copy(data, data + (need.global_end - need.global_begin), dst);
  }

 private:
  // The storage of a whole-tensor piece named kind/param.
  const float* source(const StatePiece& p) const {
    const size_t slash = p.name.find('/');
    const std::string kind = p.name.substr(0, slash), name = p.name.substr(slash + 1);
    const ParamInfo& info = model_.param(name);
    const float* base = kind == "param" ? model_.weights() : kind == "adam_m" ? opt_.m().data() : opt_.v().data();
    return base + info.offset;
  }
  MoeTransformer model_;
  AdamW opt_;
  int leaf_samples_;
  std::unique_ptr<DataLanes> lanes_;
  bool traced_ = false;
  std::function<void(const char*, int)> phase_hook_;
};

}  // namespace

ref::Config reference_config(const Scenario& s) {
  ref::Config c;
  const ModelConfig& m = s.model;
  c.vocab = m.vocab;
  c.d_model = m.d_model;
  c.n_layers = m.n_layers;
  c.n_heads = m.n_heads;
  c.seq_len = m.seq_len;
  c.d_ff = m.d_ff;
  c.experts = m.experts;
  c.top_k = m.top_k;
  c.shared_expert = m.shared_expert;
  c.init_std = m.init_std;
  c.rms_eps = m.rms_eps;
  c.aux_loss_weight = m.aux_loss_weight;
  c.z_loss_weight = m.z_loss_weight;
  c.router_skew = m.router_skew;
  c.batch = s.batch;
  c.leaf_samples = s.leaf_samples;
  const OptimConfig& o = s.optim;
  c.lr = o.lr;
  c.min_lr_ratio = o.min_lr_ratio;
  c.beta1 = o.beta1;
  c.beta2 = o.beta2;
  c.eps = o.eps;
  c.weight_decay = o.weight_decay;
  c.grad_clip = o.grad_clip;
  c.warmup_steps = o.warmup_steps;
  c.decay_steps = o.decay_steps > 0 ? o.decay_steps : s.steps;
  return c;
}

namespace {

class ReferenceTrainer : public Trainer {
 public:
  explicit ReferenceTrainer(const Scenario& s) : model_(reference_config(s), s.seed), model_cfg_(s.model) {}
  float train_step(const uint8_t* tokens, int batch, int step, float* grad_norm) override {
    ref::Losses<float> l = model_.forward_backward(tokens, batch);
    *grad_norm = model_.optimizer_step(step);
    return l.ce;
  }
  float eval_loss(const uint8_t* tokens, int batch) override { return model_.forward(tokens, batch).ce; }
  std::string state_hash() const override { return model_.state_hash(); }
  double train_flops_per_token() const override { return ls::train_flops_per_token(model_cfg_); }
  void set_trace(TraceSink* sink) override {
    if (!sink) {
      model_.trace = nullptr;
      return;
    }
    model_.trace = [sink](const char* phase, int layer, const char* op, const char* name, const float* data,
                          const std::vector<int64_t>& shape) { sink->tensor(phase, layer, op, name, data, shape); };
  }
  void debug_bump_weight(const std::string& param, int64_t index) override {
    ref::Param<float>* p = nullptr;
    for (auto& q : model_.params)
      if (q.name == param) p = &q;
    if (!p) throw UserError("--debug-bump: no parameter '" + param + "'");
    if (index < 0 || index >= p->size()) throw UserError("--debug-bump: index out of range for " + param);
    float& w = p->w[index];
    w = from_bits(bits(w) + (w >= 0 ? 1 : -1));
  }
  void set_debug_reorder_moe_norm(bool on) override {
    if (on) throw UserError("--debug-reorder: the reference has no debug reorderings (engine only)");
  }
  void stage_state(std::vector<std::vector<StatePiece>>&) override {
    throw UserError("ckpt: checkpoints are saved by the engine backend (the reference is the spec, not a trainer)");
  }
  // A restore delivers every tensor whole, as the engine's single rank needs it.
  std::vector<StatePiece> state_needs(int) const override {
    std::vector<StatePiece> out;
    for (const char* kind : {"param/", "adam_m/", "adam_v/"})
      for (const ref::Param<float>& p : model_.params) out.push_back({kind + p.name, p.shape, 0, p.size(), {}});
    return out;
  }
  void load_piece(int, const StatePiece& need, const float* data) override {
    const size_t slash = need.name.find('/');
    const std::string kind = need.name.substr(0, slash);
    ref::Param<float>& p = model_.param(need.name.substr(slash + 1));
    std::vector<float>& dst = kind == "param" ? p.w : kind == "adam_m" ? p.m : p.v;
    std::copy(data, data + (need.global_end - need.global_begin), dst.begin() + need.global_begin);
  }

 private:
  ref::Model<float> model_;
  ModelConfig model_cfg_;
};

// One line, flushed, so that a child killed right after survives in the log.
void append_step_log(const std::string& path, const std::string& line) {
  if (path.empty()) return;
  if (FILE* f = std::fopen(path.c_str(), "a")) {
    std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
  }
}

std::string fmt_duration(double s) {
  char buf[32];
  if (s < 90) std::snprintf(buf, sizeof buf, "%.0fs", s);
  else if (s < 5400) std::snprintf(buf, sizeof buf, "%.0fm%02.0fs", std::floor(s / 60), std::fmod(s, 60));
  else std::snprintf(buf, sizeof buf, "%.1fh", s / 3600);
  return buf;
}

// The run's lease on ckpt.url: its supervisor's ("JOB:GENERATION"), checked
// to be current, or one of its own (its own store: injected storage faults
// are for the checkpoints).
std::unique_ptr<CheckpointLease> take_lease(const Scenario& s, const RunOptions& opt) {
  std::shared_ptr<ObjectStore> store = open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint});
  if (!opt.lease.empty()) {
    const size_t colon = opt.lease.rfind(':');
    if (colon == std::string::npos) throw UserError("--lease: JOB:GENERATION, got '" + opt.lease + "'");
    return CheckpointLease::attach(std::move(store), opt.lease.substr(0, colon),
                                   parse_int_field(opt.lease.substr(colon + 1), 1, 999999999999, "--lease generation"));
  }
  return CheckpointLease::acquire(std::move(store), new_job_id(), s.ckpt.lease_seconds, opt.lease_wait,
                                  [](const std::string& m) { std::fprintf(stderr, "lockstep: %s\n", m.c_str()); });
}

}  // namespace

RunOptions::Bump parse_bump(const std::string& text) {
  // PARAM[INDEX]@STEP
  const size_t lb = text.find('['), rb = text.find(']'), at = text.find('@');
  RunOptions::Bump b;
  try {
    if (lb == std::string::npos || rb < lb || at != rb + 1) throw std::invalid_argument("");
    b.param = text.substr(0, lb);
    b.index = std::stoll(text.substr(lb + 1, rb - lb - 1));
    b.step = std::stoi(text.substr(at + 1));
    if (b.step < 1 || b.param.empty()) throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw UserError("--debug-bump: expected PARAM[INDEX]@STEP (e.g. layers.0.wo[5]@3), got '" + text + "'");
  }
  return b;
}

bool is_multi_rank(const Scenario& s) { return s.mesh.dp > 1 || s.mesh.ep > 1 || s.mesh.fsdp; }

std::unique_ptr<Trainer> make_trainer(const Scenario& s, Backend b) {
  // cuda-emulated and cuda train the engine's model; run_scenario installs the kernels for the run.
  if (b != Backend::kReference && is_multi_rank(s)) return std::make_unique<ClusterTrainer>(s);
  if (b != Backend::kReference) return std::make_unique<EngineTrainer>(s);
  if (is_multi_rank(s) || s.model.moe_policy == MoePolicy::kDrop)
    throw UserError("--backend reference: runs one rank and the dropless schedule only (mesh.* and moe.policy=drop "
                    "are engine features)");
  return std::make_unique<ReferenceTrainer>(s);
}

RunResult run_scenario(const Scenario& s, const RunOptions& opt) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  RunResult r;
  r.scenario = s.name;
  r.backend = backend_name(opt.backend);
  r.level = s.level;
  // The scenario's string (the loader accepts portable or local), compared once.
  const NumericsLevel level = s.level == "local" ? NumericsLevel::kLocal : NumericsLevel::kPortable;
  if (level == NumericsLevel::kLocal) r.local_gemm = ops::local::gemm_library();
  // Backend and level, process-wide for the run (the ranks of an in-process mesh are threads of this run);
  // however the run ends, other work in this process is portable, on the engine's ops. Throws for a combination
  // that does not exist.
  const ops::ExecutionTarget target = execution_target(opt.backend, level);
  const ops::ScopedExecutionTarget installed(target);
  r.device = target.device;
  r.threads = opt.backend == Backend::kReference ? 1 : omp_get_max_threads();
  r.steps = opt.steps >= 0 ? opt.steps : s.steps;
  const int T = s.model.seq_len, B = s.batch;
  // Before anything is allocated: a scenario that cannot fit is refused.
  r.memory_estimate_bytes = estimate_run_memory(s, opt).total_bytes;
  if (opt.memory_check) check_run_memory(s, opt);
  Corpus corpus = load_corpus(s.data, s.seed, T);
  // A data file counts by its content, as read: a changed byte is other numerics.
  r.fingerprint = scenario_fingerprint(
      s, s.data.path.empty() ? std::string() : xxh128_hex(corpus.bytes.data(), corpus.bytes.size()));
  std::unique_ptr<Trainer> trainer;
  if (opt.mpi) {  // one rank per process
    if (opt.mpi->size() != s.mesh.dp)
      throw UserError("mpirun started " + std::to_string(opt.mpi->size()) + " processes but mesh.dp = " +
                      std::to_string(s.mesh.dp) + ": one process per rank (use --set mesh.dp=" +
                      std::to_string(opt.mpi->size()) + " or mpirun -np " + std::to_string(s.mesh.dp) + ")");
    if (opt.backend != Backend::kEngine) throw UserError("--backend: under mpirun only the engine runs");
    if (opt.mpi->size() > 1) {
      if (!opt.trace_path.empty()) throw UserError("--trace: tracing needs mesh.dp=1 (one process)");
      trainer = std::make_unique<ClusterTrainer>(s, opt.mpi);
    }
  }
  if (!trainer) trainer = make_trainer(s, opt.backend);
  // The processes of an MPI job, when this process holds one rank of several;
  // rank 0's process alone writes the supervisor's heartbeat and step log.
  Communicator* procs = opt.mpi && opt.mpi->size() > 1 ? opt.mpi : nullptr;
  const bool lead = !procs || procs->rank() == 0;
  const std::string step_log = lead ? opt.step_log : std::string();
  if (auto* cluster = dynamic_cast<ClusterTrainer*>(trainer.get())) {
    cluster->set_threads(opt.threads > 0 ? opt.threads : omp_get_max_threads());
    cluster->set_jitter(opt.jitter_seed);
  }
  r.train_flops_per_token = trainer->train_flops_per_token();
  if (opt.debug_reorder_moe_norm) trainer->set_debug_reorder_moe_norm(true);
  std::unique_ptr<FaultInjector> injector;
  if (!opt.faults.empty()) {
    injector = std::make_unique<FaultInjector>(opt.faults, opt.fired, opt.fault_state);
    if (opt.mpi && opt.mpi->size() > 1) injector->set_process_rank(opt.mpi->rank());
    if (!s.ckpt.url.empty()) injector->rot_committed(*open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint}));
    trainer->set_phase_hook([&injector](const char* phase, int rank) {
      const std::string p = phase;
      injector->at(-1, p == "forward" ? FaultPhase::kForward : p == "backward" ? FaultPhase::kBackward
                                                                              : FaultPhase::kOptimizer, rank);
    });
  }
  std::unique_ptr<TraceWriter> tracer;
  if (!opt.trace_path.empty()) {
    nlohmann::json header = {{"backend", backend_name(opt.backend)}, {"scenario", s.name}, {"fingerprint", r.fingerprint},
                             {"resolved", s.resolved}, {"threads", r.threads}};
    if (opt.debug_reorder_moe_norm) header["debug_reorder"] = "moe_norm";
    tracer = std::make_unique<TraceWriter>(opt.trace_path, header, opt.trace_dump);
    trainer->set_trace(tracer.get());
  }
  std::vector<uint8_t> batch((size_t)B * (T + 1));

  auto evaluate = [&](int step) {
    float acc = 0.0f;  // mean over eval batches, in batch order
    for (int i = 0; i < s.eval_batches; ++i) {
      eval_batch(corpus, s.seed, i, B, T, batch.data());
      acc = acc + trainer->eval_loss(batch.data(), B);
    }
    const float bpb = (acc / (float)s.eval_batches) / 0.693147180559945309f;
    r.evals.push_back({step, bpb});
    append_step_log(step_log, "eval " + std::to_string(step) + " " + hex_bits(bpb));
    if (opt.progress) std::fprintf(stderr, "eval  step %d  held-out %.4f bits/byte\n", step, bpb);
  };

  std::map<std::string, uint64_t> train_bytes;
  double train_comm_seconds = 0;
  // One live job per checkpoint prefix: the lease is taken (or, under a
  // supervisor, joined) before anything is restored or saved. Under MPI
  // rank 0 holds it and every rank learns the outcome.
  const bool saves = !s.ckpt.url.empty() && s.ckpt.every > 0 && opt.backend != Backend::kReference;
  std::unique_ptr<CheckpointLease> lease;
  if (saves) {
    std::exception_ptr refused;
    if (lead) {
      try {
        lease = take_lease(s, opt);
      } catch (...) {
        refused = std::current_exception();
      }
    }
    if (procs) share_error(*procs, 0, refused, "");
    else if (refused) std::rethrow_exception(refused);
    if (lease) r.lease = {{"job", lease->job()}, {"generation", lease->generation()}};
  }
  // Resume: the latest (or the named) committed checkpoint, on this mesh.
  int start = 0;
  if (!opt.resume.empty()) {
    const auto [url, at] = split_checkpoint_url(opt.resume);
    std::unique_ptr<ObjectStore> from = open_store(url, StoreOptions{s.ckpt.s3_endpoint});
    RetryPolicy read_retry;  // a resume rides out an outage as long as a save would
    read_retry.budget_seconds = s.ckpt.retry_seconds;
    // The named checkpoint; or the latest committed one, falling back to older
    // committed ones when a restore finds an object corrupt.
    std::vector<int64_t> candidates = {at};
    if (at < 0) {
      candidates = committed_steps(*from, read_retry);
      std::reverse(candidates.begin(), candidates.end());
      if (candidates.empty()) throw UserError("--resume: no committed checkpoint (no manifest) in " + from->url());
    }
    nlohmann::json fallbacks = nlohmann::json::array();
    RestoreReport rep;
    Manifest m;
    bool restored = false;
    std::string tried;  // "step N (why); ..." for the error when none is usable
    // The trainer is untouched by a failed candidate (pieces load only once
    // every object read clean): fall back to the previous committed
    // checkpoint. With none left, the user's --resume stops (it never starts
    // from scratch silently); a supervised restart of its own job starts
    // over from step 0 -- the same bits, only later.
    auto fall_back = [&](size_t c, int64_t step, const std::string& why) {
      tried += (tried.empty() ? "" : "; ") + ("step " + std::to_string(step) + ": " + why);
      const bool last = c + 1 >= candidates.size();
      if (last && !opt.resume_fallback_to_start)
        throw UserError("--resume: no usable committed checkpoint in " + url + " (tried " +
                        std::to_string(candidates.size()) + ": " + tried +
                        "); not starting from scratch: fix or remove them, or run without --resume");
      const int64_t to = last ? 0 : candidates[c + 1];
      std::fprintf(stderr, "restore: checkpoint of step %lld unusable (%s); falling back to %s\n", (long long)step,
                   why.c_str(), to ? ("step " + std::to_string(to)).c_str() : "the start (no older committed checkpoint)");
      fallbacks.push_back({{"step", step}, {"why", why}});
      if (!opt.fault_state.empty() && lead)
        if (FILE* f = std::fopen(opt.fault_state.c_str(), "a")) {
          std::fprintf(f, "fallback from=%lld to=%lld\n", (long long)step, (long long)to);
          std::fclose(f);
        }
    };
    for (size_t c = 0; c < candidates.size(); ++c) {
      try {
        m = read_manifest(*from, candidates[c], read_retry);
      } catch (const CorruptCheckpoint& e) {
        if (at >= 0) throw CorruptCheckpoint(std::string("--resume: ") + e.what());  // the named checkpoint, or nothing
        fall_back(c, candidates[c], e.what());  // a torn or corrupt manifest, as a corrupt shard
        continue;
      } catch (const UserError& e) {
        throw UserError(std::string("--resume: ") + e.what());  // an input mistake: no older checkpoint mends it
      }
      if (m.fingerprint != r.fingerprint) {
        const std::vector<std::string> diffs = numerics_differences(m.scenario, s.resolved);
        std::string keys;
        bool steps_differ = false;
        for (const std::string& d : diffs) {
          keys += (keys.empty() ? "" : ", ") + d;
          steps_differ = steps_differ || d.rfind("train.steps ", 0) == 0;
        }
        // Same keys, same data file name, other fingerprint: the file's bytes changed.
        if (keys.empty() && !s.data.path.empty())
          throw UserError("--resume: data.path '" + s.data.path + "' is not the data the checkpoint of step " +
                          std::to_string(m.step) + " in " + url +
                          " was trained on: its content changed (the fingerprint covers the file's bytes; "
                          "fingerprint " + m.fingerprint + ", this run " + r.fingerprint + ")");
        throw UserError("--resume: the checkpoint of step " + std::to_string(m.step) + " in " + url +
                        " was saved by a scenario with other numerics" + (keys.empty() ? "" : ": " + keys) +
                        " (fingerprint " + m.fingerprint + ", this run " + r.fingerprint + ")" +
                        (steps_differ ? "; train.steps shapes the learning-rate schedule: keep the saved value and "
                                        "stop early with --steps N instead"
                                      : ""));
      }
      if (m.step == r.steps) {
        // The job is done (a requeued job that finished): nothing to train;
        // the summary is the committed final state.
        r.already_complete = true;
        r.resumed_from = r.steps;
        r.final_state_hash = m.state_hash;
        r.mesh = s.mesh;
        r.restore = {{"step", m.step}, {"url", url}, {"mode", "none"}, {"store_bytes_read", 0},
                     {"checkpoint_bytes", 0}, {"seconds", 0.0}, {"saved_mesh", m.mesh}, {"fallbacks", fallbacks}};
        if (opt.progress)
          std::fprintf(stderr, "resume: the checkpoint of step %lld in %s is the final step: nothing left to run\n",
                       (long long)m.step, url.c_str());
        if (tracer) tracer->finish(r.final_state_hash, r.steps);
        r.peak_rss_bytes = peak_rss_bytes();
        return r;
      }
      if (m.step > r.steps)
        throw UserError("--resume: the checkpoint is at step " + std::to_string(m.step) + ", past the " +
                        std::to_string(r.steps) + " steps of this run" +
                        (opt.steps >= 0 ? " (--steps " + std::to_string(opt.steps) + ")" : std::string()));
      try {
        rep = restore_state(*trainer, *from, m, s.ckpt.restore, procs, read_retry);
        restored = true;
        break;
      } catch (const CorruptCheckpoint& e) {  // only bad bytes fall back; any other error stops the resume
        if (at >= 0) throw;  // the named checkpoint, or nothing
        fall_back(c, m.step, e.what());
      }
    }
    start = restored ? (int)m.step : 0;
    r.resumed_from = start;
    if (!restored) rep.saved_mesh = "null";
    r.restore = {{"step", rep.step}, {"url", rep.url}, {"mode", rep.mode}, {"store_bytes_read", rep.store_bytes_read},
                 {"checkpoint_bytes", rep.checkpoint_bytes}, {"seconds", rep.seconds},
                 {"saved_mesh", nlohmann::json::parse(rep.saved_mesh)}, {"fallbacks", fallbacks}};
    if (opt.progress)
      std::fprintf(stderr, "resumed from step %lld of %s (%s restore, %llu of %llu bytes read)\n", (long long)m.step,
                   url.c_str(), rep.mode.c_str(), (unsigned long long)rep.store_bytes_read,
                   (unsigned long long)rep.checkpoint_bytes);
  }
  std::unique_ptr<CheckpointWriter> writer;
  if (!s.ckpt.url.empty() && s.ckpt.every > 0) {
    if (opt.backend == Backend::kReference)
      throw UserError("ckpt.every: checkpoints are saved by the engine (or cuda-emulated) backend");
    std::shared_ptr<ObjectStore> to = open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint});
    if (injector) to = injector->wrap(to);
    writer = std::make_unique<CheckpointWriter>(
        s.ckpt, to, s.resolved, r.fingerprint,
        nlohmann::json{{"dp", s.mesh.dp}, {"ep", s.mesh.ep}, {"fsdp", s.mesh.fsdp}, {"replicate", s.mesh.replicate}},
        procs);
    if (injector) writer->set_commit_hook([&injector](int64_t step) { injector->after_commit(step); });
    // Nothing is committed or deleted by a job that no longer holds the
    // prefix, or whose supervisor is gone (its lifeline ends it an instant later).
    writer->set_commit_guard([l = lease.get()] {
      if (!supervisor_alive()) throw LeaseLost("the supervisor is gone: not committing");
      if (l) l->check();
    });
    if (lease) writer->set_lease_token(lease->job(), lease->generation());
    if (opt.progress)  // one line per checkpoint, when it settles
      writer->set_settled_hook([](const SaveRecord& rec, const std::string& error) {
        if (error.empty())
          std::fprintf(stderr, "checkpoint step %lld: committed, %llu bytes (upload %.3f s, training stalled %.3f s)\n",
                       (long long)rec.step, (unsigned long long)rec.bytes, rec.upload_seconds, rec.stall_seconds);
        else
          std::fprintf(stderr, "checkpoint step %lld: failed, %llu bytes not committed: %s\n", (long long)rec.step,
                       (unsigned long long)rec.bytes, error.c_str());
      });
  }

  double train_seconds = 0, steady_seconds = 0;
  // --profile-ops: the training steps only (evaluation and restore excluded).
  struct ProfileOff {
    ~ProfileOff() { set_op_profiling(false); }
  } profile_off;
  if (opt.profile_ops) {
    reset_op_seconds();
    set_op_profiling(true);
  }
  auto t_start = std::chrono::steady_clock::now();
  double last_progress = -1;  // seconds into the loop of the last progress line
  for (int step = start; step < r.steps; ++step) {
    if (lease && lease->known_lost()) lease->check();  // throws LeaseLost: stop now, not at the next save
    if (!opt.heartbeat.empty() && lead) {
      // The supervisor's liveness signal: the step being run.
      if (FILE* hb = std::fopen(opt.heartbeat.c_str(), "w")) {
        std::fprintf(hb, "%d\n", step + 1);
        std::fclose(hb);
      }
    }
    // A straggler's delay (at step start) is part of the step's time, as a
    // slow rank's would be: it is timed with the step below.
    double fault_seconds = 0;
    if (injector) {
      const auto f0 = std::chrono::steady_clock::now();
      injector->set_step(step + 1);
      for (int rank = 0; rank < trainer->world(); ++rank)
        if (!procs || rank == procs->rank()) injector->at(step + 1, FaultPhase::kStepStart, rank);
      fault_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count();
    }
    train_batch(corpus, s.seed, step, B, T, batch.data());
    for (const RunOptions::Bump& b : opt.debug_bumps)
      if (b.step == step + 1) trainer->debug_bump_weight(b.param, b.index);
    if (tracer) tracer->begin_step(step + 1);
    auto t0 = std::chrono::steady_clock::now();
    float norm = 0;
    float loss = trainer->train_step(batch.data(), B, step, &norm);
    const double step_seconds =
        fault_seconds + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    train_seconds += step_seconds;
    if (step >= start + 2) steady_seconds += step_seconds;
    if (tracer) tracer->end_step(loss, norm, trainer->state_hash());
    r.losses.push_back(loss);
    r.grad_norms.push_back(norm);
    append_step_log(step_log, "step " + std::to_string(step + 1) + " " + hex_bits(loss) + " " +
                                      std::to_string(step_seconds));
    const MeshReport mr = trainer->mesh_report();
    r.moe_rounds.push_back(mr.rounds);
    r.moe_borrowed.push_back(mr.borrowed);
    r.moe_dropped.push_back(mr.dropped);
    r.moe_gemm_calls.push_back(mr.expert_gemm_calls);
    r.moe_all_to_all_calls.push_back(mr.all_to_all_calls);
    r.moe_all_to_all_bytes.push_back(mr.all_to_all_bytes);
    r.peak_expert_bytes = std::max(r.peak_expert_bytes, mr.peak_expert_bytes);
    r.peak_dispatch_bytes = std::max(r.peak_dispatch_bytes, mr.peak_dispatch_bytes);
    r.peak_routed_bytes = std::max(r.peak_routed_bytes, mr.peak_routed_bytes);
    r.peak_grad_state_bytes = std::max(r.peak_grad_state_bytes, mr.peak_grad_state_bytes);
    if (step + 1 == r.steps) {
      train_bytes = mr.bytes_sent_max;
      train_comm_seconds = mr.comm_seconds_max;
    }
    const int done = step + 1;
    for (int h : opt.hash_at)
      if (h == done) r.state_hashes[done] = trainer->state_hash();
    // A few progress lines a second at most; the first and the last always.
    const double since_start = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    if (opt.progress && (done == start + 1 || done == r.steps || since_start - last_progress >= 0.25)) {
      last_progress = since_start;
      const double tps = (double)(done - start) * B * T / train_seconds;
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      const double eta = elapsed / (done - start) * (r.steps - done);
      std::fprintf(stderr, "step %d/%d  loss %.4f  (%.3f bits/byte)  %.0f tok/s  ETA %s  moe rounds %d borrowed %lld dropped %lld\n",
                   done, r.steps, loss, loss / 0.6931471805599453, tps, fmt_duration(eta).c_str(), mr.rounds,
                   (long long)mr.borrowed, (long long)mr.dropped);
    }
    if (writer && done % s.ckpt.every == 0) {
      if (injector) injector->at(done, FaultPhase::kCkptStaging, procs ? procs->rank() : 0);
      writer->save(done, *trainer);
    }
    if (writer) writer->poll();  // MPI: commit what every rank has written
    if (opt.eval && s.eval_every > 0 && done % s.eval_every == 0 && done != r.steps) evaluate(done);
  }
  if (opt.profile_ops) {
    set_op_profiling(false);
    r.op_seconds = op_seconds();
  }
  if (writer) {
    writer->finish();
    if (lease) lease->release();  // the next job on this prefix need not wait for it to expire
    nlohmann::json saves = nlohmann::json::array();
    for (const SaveRecord& rec : writer->records())
      saves.push_back({{"step", rec.step}, {"stall_seconds", rec.stall_seconds}, {"wait_seconds", rec.wait_seconds},
                       {"stage_seconds", rec.stage_seconds}, {"upload_seconds", rec.upload_seconds},
                       {"put_seconds", rec.put_seconds}, {"bytes", rec.bytes}, {"committed", rec.committed}});
    const CheckpointWriter::StoreTrouble t = writer->store_trouble();
    r.checkpoint = {{"url", s.ckpt.url},
                    {"async", s.ckpt.async},
                    {"saves", saves},
                    {"failed_saves", t.failed_saves},
                    {"retries", t.retries},
                    {"longest_outage_seconds", t.longest_outage_seconds},
                    {"retry_seconds", s.ckpt.retry_seconds},
                    {"on_failure", s.ckpt.on_failure}};
  }
  if (opt.eval && r.steps > 0) evaluate(r.steps);
  r.final_state_hash = trainer->state_hash();
  if (tracer) tracer->finish(r.final_state_hash, r.steps);
  r.seconds = train_seconds;
  r.tokens_per_second = train_seconds > 0 ? (double)(r.steps - start) * B * T / train_seconds : 0;
  r.steady_tokens_per_second =
      steady_seconds > 0 ? (double)(r.steps - start - 2) * B * T / steady_seconds : r.tokens_per_second;
  r.last_tokens_per_expert = trainer->tokens_per_expert();
  r.mesh = s.mesh;
  // Collective bytes of the training steps (taken before evaluation adds its own).
  for (auto& [k, b] : train_bytes) r.bytes_sent_per_step[k] = r.steps > start ? (double)b / (r.steps - start) : 0;
  r.comm_seconds_per_step = r.steps > start ? train_comm_seconds / (r.steps - start) : 0;
  r.peak_rss_bytes = peak_rss_bytes();
  return r;
}

nlohmann::json result_json(const RunResult& r) {
  nlohmann::json j;
  j["scenario"] = r.scenario;
  j["fingerprint"] = r.fingerprint;
  j["backend"] = r.backend;
  if (!r.device.empty()) j["device"] = r.device;
  j["level"] = r.level;
  if (!r.local_gemm.empty()) j["local_gemm"] = r.local_gemm;
  j["threads"] = r.threads;
  j["steps"] = r.steps;
  j["final_state_hash"] = r.final_state_hash;
  // losses cover steps losses_first_step..steps (a resumed run ran only those).
  j["losses_first_step"] = r.resumed_from + 1;
  j["losses"] = r.losses;
  std::vector<std::string> bits;
  for (float l : r.losses) bits.push_back(hex_bits(l));
  j["loss_bits"] = bits;
  nlohmann::json evals = nlohmann::json::array();
  for (const EvalPoint& e : r.evals) evals.push_back({{"step", e.step}, {"bpb", e.bpb}});
  j["evals"] = evals;
  j["eval_bpb"] = r.evals.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.evals.back().bpb);
  j["tokens_per_second"] = r.tokens_per_second;
  j["steady_tokens_per_second"] = r.steady_tokens_per_second;
  j["seconds"] = r.seconds;
  j["train_flops_per_token"] = r.train_flops_per_token;
  nlohmann::json hashes = nlohmann::json::object();
  for (auto& [step, h] : r.state_hashes) hashes[std::to_string(step)] = h;
  j["state_hashes"] = hashes;
  j["mesh"] = {{"dp", r.mesh.dp}, {"ep", r.mesh.ep}, {"fsdp", r.mesh.fsdp}, {"replicate", r.mesh.replicate}};
  j["moe"] = {{"rounds", r.moe_rounds},
              {"borrowed", r.moe_borrowed},
              {"dropped", r.moe_dropped},
              {"expert_gemm_calls", r.moe_gemm_calls},
              {"all_to_all_calls", r.moe_all_to_all_calls},
              {"all_to_all_bytes", r.moe_all_to_all_bytes},
              {"peak_expert_bytes_per_rank", r.peak_expert_bytes},
              {"peak_dispatch_bytes_per_rank", r.peak_dispatch_bytes},
              {"peak_routed_bytes_per_rank", r.peak_routed_bytes},
              {"peak_grad_state_bytes_per_rank", r.peak_grad_state_bytes}};
  j["bytes_sent_per_rank_per_step"] = r.bytes_sent_per_step;
  j["comm_seconds_per_rank_per_step"] = r.comm_seconds_per_step;
  if (r.resumed_from) j["resumed_from"] = r.resumed_from;
  // true: --resume found the final step committed and trained nothing (losses empty).
  j["already_complete"] = r.already_complete;
  if (!r.checkpoint.is_null()) j["checkpoint"] = r.checkpoint;
  if (!r.restore.is_null()) j["restore"] = r.restore;
  if (!r.lease.is_null()) j["lease"] = r.lease;
  if (!r.op_seconds.empty()) j["op_seconds"] = r.op_seconds;
  j["memory"] = {{"estimated_total_bytes", r.memory_estimate_bytes}, {"peak_rss_bytes", r.peak_rss_bytes}};
  return j;
}

}  // namespace ls
