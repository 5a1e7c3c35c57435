// run_scenario (runner.h): one run of a scenario as a TrainingRun -- its
// trainer, lease, resume, checkpoint writer, steps and summary figures.
#include "runner/runner.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>

#include "ckpt/checkpointer.h"
#include "ckpt/lease.h"
#include "common/error.h"
#include "common/json_input.h"
#include "common/numerics_level.h"
#include "common/op_profile.h"
#include "common/text.h"
#include "contract.h"
#include "data/corpus.h"
#include "faults/injector.h"
#include "runner/cluster_trainer.h"
#include "runner/execution_target.h"
#include "runner/lifeline.h"
#include "runner/memory_plan.h"
#include "runner/pipeline.h"
#include "runner/stop_guard.h"
#include "store/store.h"

namespace ls {
namespace {

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

// One run of a scenario: what run_scenario sets up, then its named steps.
class TrainingRun {
 public:
  TrainingRun(const Scenario& s, const RunOptions& opt, RunResult& r);
  void take_lease();
  // --resume: restores the latest (or the named) usable committed
  // checkpoint. False when that checkpoint is the final step: nothing to run.
  bool resume();
  void open_writer();
  void train();
  void finish();

 private:
  void make_trainer();
  void make_injector_and_tracer();
  void plant_mesh_fault();
  void evaluate(int step);
  // A checkpoint of another scenario's numerics, or of other data: UserError naming what differs.
  void check_fingerprint(const Manifest& m, const std::string& url) const;
  // rep: the restore that read and checked the final checkpoint.
  void finish_already_complete(const Manifest& m, const std::string& url, const nlohmann::json& fallbacks,
                               const RestoreReport& rep);
  void run_step(int step);
  void record_step(int step, float loss, double step_seconds);
  void progress_line(int done, float loss, const MeshReport& mr);
  void finish_checkpoints();
  void measure_peak_rss();

  const Scenario& s_;
  const RunOptions& opt_;
  RunResult& r_;
  const int T_, B_;
  Corpus corpus_;
  std::unique_ptr<Trainer> trainer_;
  // The processes of an MPI job, when this process holds one rank of several;
  // rank 0's process alone writes the supervisor's heartbeat and step log.
  Communicator* procs_ = nullptr;
  bool lead_ = true;
  std::string step_log_;
  std::unique_ptr<FaultInjector> injector_;
  std::unique_ptr<TraceWriter> tracer_;       // process 0's (the only one's without MPI)
  std::unique_ptr<TraceSink> follower_sink_;  // MPI, other processes: traced, written by process 0
  std::vector<uint8_t> batch_;
  std::unique_ptr<CheckpointLease> lease_;
  std::unique_ptr<LeaseStopGuard> stop_guard_;  // a lease this process took: released on SIGINT/SIGTERM
  std::unique_ptr<CheckpointWriter> writer_;
  int start_ = 0;
  double train_seconds_ = 0, steady_seconds_ = 0;
  std::map<std::string, uint64_t> train_bytes_;
  double train_comm_seconds_ = 0;
  double train_in_flight_seconds_ = 0;
  std::map<std::string, double> train_comm_by_kind_;
  std::chrono::steady_clock::time_point t_start_;
  double last_progress_ = -1;  // seconds into the loop of the last progress line
  std::vector<MeshReport::ContextRank> context_sum_;  // context parallel: sums over the steps measured
  int context_steps_ = 0;
};

TrainingRun::TrainingRun(const Scenario& s, const RunOptions& opt, RunResult& r)
    : s_(s), opt_(opt), r_(r), T_(s.model.seq_len), B_(s.batch) {
  r.threads = opt.backend == Backend::kReference ? 1 : omp_get_max_threads();
  r.steps = opt.steps >= 0 ? opt.steps : s.steps;
  // Before anything is allocated: a scenario that cannot fit is refused.
  r.memory_estimate_bytes = estimate_run_memory(s, opt).total_bytes;
  if (opt.memory_check) check_run_memory(s, opt);
  corpus_ = load_corpus(s.data, s.seed, T_);
  // A data file counts by its content, as read: a changed byte is other numerics.
  r.fingerprint = scenario_fingerprint(
      s, s.data.path.empty() ? std::string() : xxh128_hex(corpus_.bytes.data(), corpus_.bytes.size()));
  make_trainer();
  make_injector_and_tracer();
  batch_.resize((size_t)B_ * (T_ + 1));
}

void TrainingRun::make_trainer() {
  const Scenario& s = s_;
  const RunOptions& opt = opt_;
  if (opt.mpi) {  // one rank per process
    if (opt.mpi->size() != s.mesh.world())
      throw UserError("mpirun started " + std::to_string(opt.mpi->size()) + " processes but " +
                      s.mesh.world_formula() + ": one process per rank (mpirun -np " +
                      std::to_string(s.mesh.world()) + ")");
    if (opt.backend != Backend::kEngine) throw UserError("--backend: under mpirun only the engine runs");
    if (opt.mpi->size() > 1) {
      trainer_ = std::make_unique<ClusterTrainer>(s, opt.mpi);
    }
  }
  if (!trainer_) trainer_ = ls::make_trainer(s, opt.backend);
  procs_ = opt.mpi && opt.mpi->size() > 1 ? opt.mpi : nullptr;
  lead_ = !procs_ || procs_->rank() == 0;
  step_log_ = lead_ ? opt.step_log : std::string();
  if (auto* cluster = dynamic_cast<ClusterTrainer*>(trainer_.get())) {
    cluster->set_threads(opt.threads > 0 ? opt.threads : omp_get_max_threads());
    cluster->set_jitter(opt.jitter_seed);
  }
  r_.train_flops_per_token = trainer_->train_flops_per_token();
  if (opt.debug_reorder_moe_norm) trainer_->set_debug_reorder_moe_norm(true);
  if (!opt.debug_mesh_fault.empty()) plant_mesh_fault();
  r_.debug_mesh_fault = opt.debug_mesh_fault;
}

// --debug-mesh-fault KIND: on a mesh with the axis it perturbs.
void TrainingRun::plant_mesh_fault() {
  const MeshConfig& m = s_.mesh;
  const std::string& kind = opt_.debug_mesh_fault;
  struct Kind {
    const char* name;
    MeshFault fault;
    bool applies;
    const char* needs;
  };
  const Kind kinds[] = {{"tp_chain", MeshFault::kTpChain, m.tp > 1, "mesh.tp > 1"},
                        {"cp_handoff", MeshFault::kCpHandoff, m.cp > 1, "mesh.cp > 1"},
                        {"pp_activation", MeshFault::kPpActivation, m.pp > 1, "mesh.pp > 1"},
                        {"ep_row", MeshFault::kEpRow, m.ep > 1, "mesh.ep > 1"},
                        {"fsdp_block", MeshFault::kFsdpBlock, m.shard_group() > 1, "sharded state (mesh.fsdp or mesh.shard_optimizer on mesh.dp > 1)"}};
  for (const Kind& k : kinds) {
    if (kind != k.name) continue;
    auto* cluster = dynamic_cast<ClusterTrainer*>(trainer_.get());
    if (!cluster || !k.applies) throw UserError("--debug-mesh-fault " + kind + ": needs " + k.needs);
    cluster->set_debug_mesh_fault(k.fault);
    return;
  }
  throw UserError("--debug-mesh-fault: one of tp_chain, cp_handoff, pp_activation, ep_row, fsdp_block; got '" +
                  quote_for_message(kind) + "'");
}

void TrainingRun::make_injector_and_tracer() {
  const Scenario& s = s_;
  const RunOptions& opt = opt_;
  if (!opt.faults.empty()) {
    injector_ = std::make_unique<FaultInjector>(opt.faults, opt.fired, opt.fault_state);
    if (opt.mpi && opt.mpi->size() > 1) injector_->set_process_rank(opt.mpi->rank());
    if (!s.ckpt.url.empty()) injector_->rot_committed(*open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint}));
    trainer_->set_phase_hook([this](TrainPhase phase, int rank) {
      injector_->at(-1, phase == TrainPhase::kForward    ? FaultPhase::kForward
                        : phase == TrainPhase::kBackward ? FaultPhase::kBackward
                                                         : FaultPhase::kOptimizer,
                    rank);
    });
  }
  if (!opt.trace_path.empty()) {
    nlohmann::json header = {{"backend", backend_name(opt.backend)}, {"scenario", s.name}, {"fingerprint", r_.fingerprint},
                             {"resolved", s.resolved}, {"threads", r_.threads}};
    if (opt.debug_reorder_moe_norm) header["debug_reorder"] = "moe_norm";
    if (!opt.debug_mesh_fault.empty()) header["debug_mesh_fault"] = opt.debug_mesh_fault;
    for (const RunOptions::Bump& b : opt.debug_bumps)
      header["debug_bumps"].push_back(b.param + "[" + std::to_string(b.index) + "]@" + std::to_string(b.step));
    if (lead_) {
      tracer_ = std::make_unique<TraceWriter>(opt.trace_path, header, opt.trace_dump);
      trainer_->set_trace(tracer_.get());
    } else {  // MPI: this process's pieces go to process 0, which writes
      struct Discard : TraceSink {
        void tensor(const char*, int, const char*, const char*, const float*, const std::vector<int64_t>&,
                    TraceDtype = TraceDtype::kF32) override {}
      };
      follower_sink_ = std::make_unique<Discard>();
      trainer_->set_trace(follower_sink_.get());
    }
  }
}

void TrainingRun::evaluate(int step) {
  float acc = 0.0f;  // mean over eval batches, in batch order
  for (int i = 0; i < s_.eval_batches; ++i) {
    eval_batch(corpus_, s_.seed, i, B_, T_, batch_.data());
    acc = acc + trainer_->eval_loss(batch_.data(), B_);
  }
  const float bpb = (acc / (float)s_.eval_batches) / 0.693147180559945309f;
  r_.evals.push_back({step, bpb});
  append_step_log(step_log_, "eval " + std::to_string(step) + " " + hex_bits(bpb));
  if (opt_.progress) std::fprintf(stderr, "eval  step %d  held-out %.4f bits/byte\n", step, bpb);
}

void TrainingRun::take_lease() {
  // One live job per checkpoint prefix: the lease is taken (or, under a
  // supervisor, joined) before anything is restored or saved. Under MPI
  // rank 0 holds it and every rank learns the outcome.
  const bool saves = !s_.ckpt.url.empty() && s_.ckpt.every > 0 && opt_.backend != Backend::kReference;
  if (saves) {
    std::exception_ptr refused;
    if (lead_) {
      try {
        lease_ = ls::take_lease(s_, opt_);
      } catch (...) {
        refused = std::current_exception();
      }
    }
    if (procs_) share_error(*procs_, 0, refused, "");
    else if (refused) std::rethrow_exception(refused);
    if (lease_) r_.lease = {{"job", lease_->job()}, {"generation", lease_->generation()}};
    if (lease_ && lease_->owned()) stop_guard_ = std::make_unique<LeaseStopGuard>(*lease_, s_.ckpt.url);
  }
}

bool TrainingRun::resume() {
  const auto [url, at] = split_checkpoint_url(opt_.resume);
  std::unique_ptr<ObjectStore> from = open_store(url, StoreOptions{s_.ckpt.s3_endpoint});
  RetryPolicy read_retry;  // a resume rides out an outage as long as a save would
  read_retry.budget_seconds = s_.ckpt.retry_seconds;
  // The named checkpoint; or the latest committed one, falling back to older
  // committed ones when a restore finds an object corrupt.
  std::vector<int64_t> candidates = {at};
  if (at < 0) {
    candidates = committed_steps(*from, read_retry);
    std::reverse(candidates.begin(), candidates.end());
    if (candidates.empty()) throw UserError("--resume: " + no_checkpoint_in(*from));
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
    if (last && !opt_.resume_fallback_to_start)
      throw UserError("--resume: no usable committed checkpoint in " + url + " (tried " +
                      std::to_string(candidates.size()) + ": " + tried +
                      "); not starting from scratch: fix or remove them, or run without --resume");
    const int64_t to = last ? 0 : candidates[c + 1];
    std::fprintf(stderr, "restore: checkpoint of step %lld unusable (%s); falling back to %s\n", (long long)step,
                 why.c_str(), to ? ("step " + std::to_string(to)).c_str() : "the start (no older committed checkpoint)");
    fallbacks.push_back({{"step", step}, {"why", why}});
    if (!opt_.fault_state.empty() && lead_)
      if (FILE* f = std::fopen(opt_.fault_state.c_str(), "a")) {
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
    check_fingerprint(m, url);
    if (m.step > r_.steps)
      throw UserError("--resume: the checkpoint is at step " + std::to_string(m.step) + ", past the " +
                      std::to_string(r_.steps) + " steps of this run" +
                      (opt_.steps >= 0 ? " (--steps " + std::to_string(opt_.steps) + ")" : std::string()));
    try {
      // The final step too is read whole, every object checked against the
      // manifest's checksums, before the run calls itself complete: a
      // corrupt final checkpoint falls back (or, named, stops) as any other.
      rep = restore_state(*trainer_, *from, m, s_.ckpt.restore, procs_, read_retry);
      restored = true;
      break;
    } catch (const CorruptCheckpoint& e) {  // only bad bytes fall back; any other error stops the resume
      if (at >= 0) throw;  // the named checkpoint, or nothing
      fall_back(c, m.step, e.what());
    }
  }
  if (restored && m.step == r_.steps) {
    finish_already_complete(m, url, fallbacks, rep);
    return false;
  }
  start_ = restored ? (int)m.step : 0;
  r_.resumed_from = start_;
  // The trace says where it starts, so that diff compares the steps both traces hold.
  if (tracer_ && restored) tracer_->resumed_from(start_ + 1, {{"url", url}, {"step", m.step}});
  if (!restored) rep.saved_mesh = "null";
  r_.restore = {{"step", rep.step}, {"url", rep.url}, {"mode", rep.mode}, {"store_bytes_read", rep.store_bytes_read},
                {"checkpoint_bytes", rep.checkpoint_bytes}, {"seconds", rep.seconds},
                {"saved_mesh", nlohmann::json::parse(rep.saved_mesh)}, {"fallbacks", fallbacks}};
  if (opt_.progress)
    std::fprintf(stderr, "resumed from step %lld of %s (%s restore, %llu of %llu bytes read)\n", (long long)m.step,
                 url.c_str(), rep.mode.c_str(), (unsigned long long)rep.store_bytes_read,
                 (unsigned long long)rep.checkpoint_bytes);
  return true;
}

void TrainingRun::check_fingerprint(const Manifest& m, const std::string& url) const {
  if (m.fingerprint == r_.fingerprint) return;
  const std::vector<std::string> diffs = numerics_differences(m.scenario, s_.resolved);
  std::string keys;
  bool steps_differ = false;
  for (const std::string& d : diffs) {
    keys += (keys.empty() ? "" : ", ") + d;
    steps_differ = steps_differ || d.rfind("train.steps ", 0) == 0;
  }
  // Same keys, same data file name, other fingerprint: the file's bytes changed.
  if (keys.empty() && !s_.data.path.empty())
    throw UserError("--resume: data.path '" + s_.data.path + "' is not the data the checkpoint of step " +
                    std::to_string(m.step) + " in " + url +
                    " was trained on: its content changed (the fingerprint covers the file's bytes; "
                    "fingerprint " + m.fingerprint + ", this run " + r_.fingerprint + ")");
  throw UserError("--resume: the checkpoint of step " + std::to_string(m.step) + " in " + url +
                  " was saved by a scenario with other numerics" + (keys.empty() ? "" : ": " + keys) +
                  " (fingerprint " + m.fingerprint + ", this run " + r_.fingerprint + ")" +
                  (steps_differ ? "; train.steps shapes the learning-rate schedule: keep the saved value and "
                                  "stop early with --steps N instead"
                                : ""));
}

// The job is done (a requeued job that finished): nothing to train; the
// summary is the committed final state, read back whole and checked.
void TrainingRun::finish_already_complete(const Manifest& m, const std::string& url, const nlohmann::json& fallbacks,
                                          const RestoreReport& rep) {
  r_.already_complete = true;
  r_.resumed_from = r_.steps;
  r_.final_state_hash = m.state_hash;
  r_.mesh = s_.mesh;
  r_.microbatches = s_.microbatches;
  r_.pipeline_bubble_formula = pipeline_bubble_formula(parse_pipeline_schedule(s_.mesh.pp_schedule), s_.mesh.pp,
                                                       s_.mesh.pp_virtual, s_.microbatches);
  r_.restore = {{"step", m.step}, {"url", url}, {"mode", rep.mode}, {"store_bytes_read", rep.store_bytes_read},
                {"checkpoint_bytes", rep.checkpoint_bytes}, {"seconds", rep.seconds}, {"saved_mesh", m.mesh},
                {"fallbacks", fallbacks}, {"verified", true}};
  if (opt_.progress)
    std::fprintf(stderr,
                 "resume: the checkpoint of step %lld in %s is the final step (read back, %llu bytes, checksums "
                 "match): nothing left to run\n",
                 (long long)m.step, url.c_str(), (unsigned long long)rep.store_bytes_read);
  if (tracer_) {
    tracer_->resumed_from(r_.steps + 1, {{"url", url}, {"step", m.step}});
    tracer_->finish(r_.final_state_hash, r_.steps);
  }
  measure_peak_rss();
}

void TrainingRun::open_writer() {
  if (s_.ckpt.url.empty() || s_.ckpt.every <= 0) return;
  if (opt_.backend == Backend::kReference)
    throw UserError("ckpt.every: checkpoints are saved by the engine (or cuda-emulated) backend");
  std::shared_ptr<ObjectStore> to = open_store(s_.ckpt.url, StoreOptions{s_.ckpt.s3_endpoint});
  if (injector_) to = injector_->wrap(to);
  writer_ = std::make_unique<CheckpointWriter>(s_.ckpt, to, s_.resolved, r_.fingerprint,
                                               mesh_json(s_.mesh, s_.microbatches), procs_);
  if (injector_) writer_->set_commit_hook([this](int64_t step) { injector_->after_commit(step); });
  // Nothing is committed or deleted by a job that no longer holds the
  // prefix, or whose supervisor is gone (its lifeline ends it, here or an instant later).
  writer_->set_commit_guard([l = lease_.get()] {
    require_supervisor();  // does not return once the supervisor is gone
    if (l) l->check();
  });
  if (lease_) writer_->set_lease_token(lease_->job(), lease_->generation());
  if (opt_.progress)  // one line per checkpoint, when it settles
    writer_->set_settled_hook([](const SaveRecord& rec, const std::string& error) {
      if (error.empty())
        std::fprintf(stderr, "checkpoint step %lld: committed, %llu bytes (upload %.3f s, training stalled %.3f s)\n",
                     (long long)rec.step, (unsigned long long)rec.bytes, rec.upload_seconds, rec.stall_seconds);
      else
        std::fprintf(stderr, "checkpoint step %lld: failed, %llu bytes not committed: %s\n", (long long)rec.step,
                     (unsigned long long)rec.bytes, error.c_str());
    });
}

void TrainingRun::train() {
  // --profile-ops: the training steps only (evaluation and restore excluded).
  struct ProfileOff {
    ~ProfileOff() { set_op_profiling(false); }
  } profile_off;
  if (opt_.profile_ops) {
    reset_op_seconds();
    set_op_profiling(true);
  }
  t_start_ = std::chrono::steady_clock::now();
  for (int step = start_; step < r_.steps; ++step) run_step(step);
  if (opt_.profile_ops) {
    set_op_profiling(false);
    r_.op_seconds = op_seconds();
  }
}

// Step `step` (0-based): faults, the batch, the trainer's step, what the
// summary and the supervisor learn of it, a checkpoint, an evaluation.
void TrainingRun::run_step(int step) {
  if (lease_ && lease_->known_lost()) lease_->check();  // throws LeaseLost: stop now, not at the next save
  const int done = step + 1;
  if (stop_guard_) stop_guard_->at_step(done);
  if (lead_) write_heartbeat(opt_.heartbeat, done);
  // A straggler's delay (at step start) is part of the step's time, as a
  // slow rank's would be: it is timed with the step below.
  double fault_seconds = 0;
  if (injector_) {
    const auto f0 = std::chrono::steady_clock::now();
    injector_->set_step(done);
    for (int rank = 0; rank < trainer_->world(); ++rank)
      if (!procs_ || rank == procs_->rank()) injector_->at(done, FaultPhase::kStepStart, rank);
    fault_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count();
  }
  train_batch(corpus_, s_.seed, step, B_, T_, batch_.data());
  for (const RunOptions::Bump& b : opt_.debug_bumps)
    if (b.step == done) trainer_->debug_bump_weight(b.param, b.index);
  if (tracer_) tracer_->begin_step(done);
  const auto t0 = std::chrono::steady_clock::now();
  float norm = 0;
  const float loss = trainer_->train_step(batch_.data(), B_, step, &norm);
  const double step_seconds =
      fault_seconds + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!opt_.trace_path.empty()) {
    const std::string hash = trainer_->state_hash();  // under MPI a collective: every process takes part
    if (tracer_) tracer_->end_step(loss, norm, hash);
  }
  r_.grad_norms.push_back(norm);
  record_step(step, loss, step_seconds);
  if (writer_ && done % s_.ckpt.every == 0) {
    if (injector_) injector_->at(done, FaultPhase::kCkptStaging, procs_ ? procs_->rank() : 0);
    writer_->save(done, *trainer_);
  }
  if (writer_) writer_->poll();  // MPI: commit what every rank has written
  if (opt_.eval && s_.eval_every > 0 && done % s_.eval_every == 0 && done != r_.steps) evaluate(done);
}

void TrainingRun::record_step(int step, float loss, double step_seconds) {
  const int done = step + 1;
  train_seconds_ += step_seconds;
  if (step >= start_ + 2) steady_seconds_ += step_seconds;
  r_.losses.push_back(loss);
  append_step_log(step_log_, "step " + std::to_string(done) + " " + hex_bits(loss) + " " + std::to_string(step_seconds));
  const MeshReport mr = trainer_->mesh_report();
  r_.moe_rounds.push_back(mr.rounds);
  r_.moe_borrowed.push_back(mr.borrowed);
  r_.moe_dropped.push_back(mr.dropped);
  r_.moe_gemm_calls.push_back(mr.expert_gemm_calls);
  r_.moe_all_to_all_calls.push_back(mr.all_to_all_calls);
  r_.moe_all_to_all_bytes.push_back(mr.all_to_all_bytes);
  r_.moe_all_to_all_started.push_back(mr.all_to_all_started);
  r_.peak_expert_bytes = std::max(r_.peak_expert_bytes, mr.peak_expert_bytes);
  r_.peak_dispatch_bytes = std::max(r_.peak_dispatch_bytes, mr.peak_dispatch_bytes);
  r_.peak_routed_bytes = std::max(r_.peak_routed_bytes, mr.peak_routed_bytes);
  r_.peak_grad_state_bytes = std::max(r_.peak_grad_state_bytes, mr.peak_grad_state_bytes);
  r_.workspace_bytes = std::max(r_.workspace_bytes, mr.workspace_bytes);
  r_.pipeline = mr.pipeline;
  for (int op = 0; op < kStreamOps; ++op) r_.stream_rows[stream_op_name((StreamOp)op)] = mr.stream_rows_max[op];
  if (!mr.context.empty() && (step > start_ || done == r_.steps)) {  // means after the first step (finish)
    if (context_steps_ == 0) context_sum_.assign(mr.context.size(), {});
    ++context_steps_;
    for (size_t c = 0; c < mr.context.size(); ++c) context_sum_[c].add_step(mr.context[c]);
  }
  r_.weight_bytes = std::max(r_.weight_bytes, mr.weight_bytes);
  if (done == r_.steps) {
    train_bytes_ = mr.bytes_sent_max;
    train_comm_seconds_ = mr.comm_seconds_max;
    train_in_flight_seconds_ = mr.comm_in_flight_seconds_max;
    train_comm_by_kind_ = mr.comm_seconds_by_kind_max;
  }
  for (int h : opt_.hash_at)
    if (h == done) r_.state_hashes[done] = trainer_->state_hash();
  progress_line(done, loss, mr);
}

// A few progress lines a second at most, or a log's few (progress_due).
void TrainingRun::progress_line(int done, float loss, const MeshReport& mr) {
  const double since_start = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start_).count();
  if (!progress_due(opt_, since_start, last_progress_, done == start_ + 1, done == r_.steps)) return;
  last_progress_ = since_start;
  const double tps = (double)(done - start_) * B_ * T_ / train_seconds_;
  const double eta = since_start / (done - start_) * (r_.steps - done);
  std::fprintf(stderr, "step %d/%d  loss %.4f  (%.3f bits/byte)  %.0f tok/s  ETA %s  moe rounds %d borrowed %lld dropped %lld\n",
               done, r_.steps, loss, loss / 0.6931471805599453, tps, fmt_duration(eta).c_str(), mr.rounds,
               (long long)mr.borrowed, (long long)mr.dropped);
}

void TrainingRun::finish_checkpoints() {
  if (!writer_) return;
  writer_->finish();
  if (lease_) lease_->release();  // the next job on this prefix need not wait for it to expire
  nlohmann::json saves = nlohmann::json::array();
  for (const SaveRecord& rec : writer_->records())
    saves.push_back({{"step", rec.step}, {"stall_seconds", rec.stall_seconds}, {"wait_seconds", rec.wait_seconds},
                     {"stage_seconds", rec.stage_seconds}, {"upload_seconds", rec.upload_seconds},
                     {"put_seconds", rec.put_seconds}, {"bytes", rec.bytes}, {"committed", rec.committed}});
  const CheckpointWriter::StoreTrouble t = writer_->store_trouble();
  r_.checkpoint = {{"url", s_.ckpt.url},
                   {"async", s_.ckpt.async},
                   {"saves", saves},
                   {"failed_saves", t.failed_saves},
                   {"retries", t.retries},
                   {"longest_outage_seconds", t.longest_outage_seconds},
                   {"retry_seconds", s_.ckpt.retry_seconds},
                   {"on_failure", s_.ckpt.on_failure}};
}

void TrainingRun::finish() {
  finish_checkpoints();
  if (opt_.eval && r_.steps > 0) evaluate(r_.steps);
  r_.final_state_hash = trainer_->state_hash();
  if (tracer_) tracer_->finish(r_.final_state_hash, r_.steps);
  r_.seconds = train_seconds_;
  const int ran = r_.steps - start_;
  r_.tokens_per_second = train_seconds_ > 0 ? (double)ran * B_ * T_ / train_seconds_ : 0;
  r_.steady_tokens_per_second =
      steady_seconds_ > 0 ? (double)(ran - 2) * B_ * T_ / steady_seconds_ : r_.tokens_per_second;
  r_.last_tokens_per_expert = trainer_->tokens_per_expert();
  for (MeshReport::ContextRank c : context_sum_) {
    c.attention_seconds /= context_steps_;
    c.bytes_sent /= context_steps_;
    c.kv_bytes_sent /= context_steps_;
    c.link_messages /= context_steps_;
    r_.context.push_back(c);
  }
  r_.mesh = s_.mesh;
  r_.microbatches = s_.microbatches;
  r_.pipeline_bubble_formula = pipeline_bubble_formula(parse_pipeline_schedule(s_.mesh.pp_schedule), s_.mesh.pp,
                                                       s_.mesh.pp_virtual, s_.microbatches);
  // Collective bytes of the training steps (taken before evaluation adds its own).
  for (auto& [k, b] : train_bytes_) r_.bytes_sent_per_step[k] = ran > 0 ? (double)b / ran : 0;
  r_.comm_seconds_per_step = ran > 0 ? train_comm_seconds_ / ran : 0;
  r_.comm_in_flight_seconds_per_step = ran > 0 ? train_in_flight_seconds_ / ran : 0;
  for (auto& [k, t] : train_comm_by_kind_)
    if (t > 0) r_.comm_seconds_by_kind_per_step[k] = ran > 0 ? t / ran : 0;
  measure_peak_rss();
}

// The peak RSS the estimate is held to: this process's; under MPI the largest
// of every process's (each holds one rank), gathered, with the list.
void TrainingRun::measure_peak_rss() {
  r_.peak_rss_bytes = peak_rss_bytes();
  if (!procs_) return;
  r_.peak_rss_per_process.assign((size_t)procs_->size(), 0);
  all_gather_equal(*procs_, &r_.peak_rss_bytes, r_.peak_rss_per_process.data(), sizeof(uint64_t));
  r_.peak_rss_bytes = *std::max_element(r_.peak_rss_per_process.begin(), r_.peak_rss_per_process.end());
}

}  // namespace

RunResult run_scenario(const Scenario& s, const RunOptions& opt) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  RunResult r;
  r.scenario = s.name;
  r.backend = backend_name(opt.backend);
  r.level = s.level;
  // The scenario's string (the loader accepts portable or local), compared once.
  const NumericsLevel level = s.level == "local" ? NumericsLevel::kLocal : NumericsLevel::kPortable;
  // Backend and level, process-wide for the run (an in-process mesh's ranks are its threads); however the run
  // ends, other work in this process is portable, on the engine's ops. Throws for a combination that does not exist.
  const ops::ExecutionTarget target = execution_target(opt.backend, level, precision_of(r.precision = s.precision));
  const int64_t fallbacks_before = name_libraries(target, opt.backend, r);
  const ops::ScopedExecutionTarget installed(target);
  r.device = target.device;
  TrainingRun run(s, opt, r);
  run.take_lease();
  if (!opt.resume.empty() && !run.resume()) return r;  // the checkpoint is the final step
  run.open_writer();
  run.train();
  run.finish();
  count_gemm_bf16_fallbacks(fallbacks_before, r);
  return r;
}

}  // namespace ls
