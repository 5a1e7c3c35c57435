// lockstep run: trains a scenario and prints its summary. Three ways: every
// rank a thread of this process; --launcher mpi, this process handing over
// to mpirun (one process per rank); or supervised (--supervise, --fault),
// this process restarting the job from its checkpoints as children.
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/mpirun.h"
#include "cli/self_exe.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "faults/fault_spec.h"
#include "faults/injector.h"
#include "runner/lifeline.h"
#include "runner/memory_plan.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "runner/supervisor.h"

namespace fs = std::filesystem;

namespace ls {
namespace {

// --out DIR must be a folder we can write, checked before any training: a
// plain file or a read-only folder is refused at once, with the OS's reason.
void check_output_dir(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw UserError("--out " + dir + ": exists and is not a folder");
  fs::create_directories(dir, ec);
  if (ec) throw UserError("--out " + dir + ": cannot create the folder: " + ec.message());
  const fs::path probe = fs::path(dir) / ".lockstep-write-test";
  std::FILE* f = std::fopen(probe.c_str(), "w");
  if (!f) throw UserError("--out " + dir + ": cannot write there: " + std::strerror(errno));
  std::fclose(f);
  fs::remove(probe, ec);
}

std::string format_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// How the mesh's ranks ran, for the summaries: "threads" (every rank a thread
// of one process) or "mpi" (one process per rank under mpirun).
std::string launcher_line(const std::string& launcher, int processes, int ranks) {
  if (launcher == "mpi")
    return "mpi (" + std::to_string(processes) + " process" + (processes == 1 ? "" : "es") +
           " under mpirun, one rank each)";
  return "threads (1 process" +
         (ranks > 1 ? "; the mesh's " + std::to_string(ranks) + " ranks are threads of it" : std::string()) + ")";
}

// "saved on one rank, resharded onto dp 2" when the checkpoint resumed was
// saved on another mesh than this run's; else nothing.
std::string resharded(const RunResult& r, const Scenario& s) {
  const nlohmann::json saved =
      r.restore.is_object() ? r.restore.value("saved_mesh", nlohmann::json()) : nlohmann::json();
  if (!saved.is_object() || saved.empty()) return "";
  int mb = 1;
  const std::string was = mesh_from_json(saved, &mb).describe(mb), now = s.mesh.describe(s.microbatches);
  return was == now ? "" : "saved on " + was + ", resharded onto " + now;
}

void print_summary(const RunResult& r, const Scenario& s, const std::string& launcher, int processes) {
  std::printf("scenario        %s (%s backend, %d thread%s)\n", r.scenario.c_str(), r.backend.c_str(), r.threads,
              r.threads == 1 ? "" : "s");
  if (!r.device.empty()) std::printf("device          %s\n", r.device.c_str());
  if (!r.local_gemm.empty())
    std::printf("numerics        local: %s; GEMMs by %s%s%s\n",
                launcher == "mpi" ? "the ranks' sums in the MPI library's order; not bitwise across threads or meshes"
                                  : "the same bits run to run at this thread count and mesh only",
                r.local_gemm.c_str(), r.local_gemm_bf16.empty() ? "" : ", bf16 products by ",
                r.local_gemm_bf16.c_str());
  if (!r.gemm_bf16_path.empty())
    std::printf("numerics        bf16 products on the %s path%s\n", r.gemm_bf16_path.c_str(),
                r.gemm_bf16_fallback_calls == 0
                    ? ""
                    : ("; " + std::to_string(r.gemm_bf16_fallback_calls) +
                       " calls with products below 2^-149 ran on avx512 (the same bits, slower)")
                          .c_str());
  std::printf("model           d_model %d, %d layers, %d heads, %d experts top-%d, seq %d, batch %d\n",
              s.model.d_model, s.model.n_layers, s.model.n_heads, s.model.experts, s.model.top_k, s.model.seq_len,
              s.batch);
  if (s.mesh.multi_rank(s.microbatches))
    std::printf("mesh            %s\n", s.mesh.describe(s.microbatches).c_str());
  std::printf("launcher        %s\n", launcher_line(launcher, processes, s.mesh.world()).c_str());
  if (!r.debug_mesh_fault.empty())
    std::printf("debug fault     %s (--debug-mesh-fault): one bit flipped once a step in the mesh's machinery; "
                "the bits are wrong by design\n",
                r.debug_mesh_fault.c_str());
  if (s.data.path.empty())
    std::printf("data            synthetic corpus, %llu bytes\n", (unsigned long long)s.data.synthetic_bytes);
  else
    std::printf("data            %s\n", s.data.path.c_str());
  if (r.already_complete) {
    std::printf("resumed         the checkpoint of step %d in %s is the final step: nothing was left to run\n",
                r.resumed_from, r.restore.value("url", std::string("?")).c_str());
    std::printf("                read back whole first: %llu bytes, every object's checksum as its manifest says\n",
                (unsigned long long)r.restore.value("store_bytes_read", (uint64_t)0));
  }
  else if (r.resumed_from > 0) {
    std::printf("resumed         from the checkpoint of step %d in %s; this run trained steps %d-%d\n", r.resumed_from,
                r.restore.value("url", std::string("?")).c_str(), r.resumed_from + 1, r.steps);
    if (const std::string moved = resharded(r, s); !moved.empty()) std::printf("                %s\n", moved.c_str());
  }
  if (!r.restore.is_null())
    for (const auto& f : r.restore.value("fallbacks", nlohmann::json::array()))
      std::printf("                the checkpoint of step %lld was unusable: %s\n", (long long)f.value("step", 0),
                  f.value("why", "").c_str());
  if (!s.ckpt.url.empty() && s.ckpt.every > 0)
    std::printf("checkpoints     %s, every %d steps (%zu saved)\n", s.ckpt.url.c_str(), s.ckpt.every,
                r.checkpoint.is_null() ? (size_t)0 : r.checkpoint["saves"].size());
  if (!r.checkpoint.is_null() && r.checkpoint.value("failed_saves", 0) > 0)
    std::printf("                %d FAILED (the store stayed unavailable past ckpt.retry_seconds = %g s); training "
                "went on\n",
                r.checkpoint.value("failed_saves", 0), r.checkpoint.value("retry_seconds", 0.0));
  if (!r.checkpoint.is_null() && r.checkpoint.value("retries", 0) > 0)
    std::printf("                store trouble ridden out: %d retries, the longest outage %.2f s\n",
                r.checkpoint.value("retries", 0), r.checkpoint.value("longest_outage_seconds", 0.0));
  if (!r.losses.empty())
    std::printf("loss            %.4f -> %.4f nats/byte over steps %d-%d\n", r.losses.front(), r.losses.back(),
                r.resumed_from + 1, r.steps);
  for (const EvalPoint& e : r.evals) std::printf("held-out        step %-6d %.4f bits/byte\n", e.step, e.bpb);
  if (!r.already_complete)
    std::printf("speed           %.0f tokens/s (%.2f GFLOP/s model)\n", r.tokens_per_second,
                r.tokens_per_second * r.train_flops_per_token * 1e-9);
  // The measured peak and the estimate it is held to, and what they cover
  // (--launcher mpi: one process each, the largest).
  std::printf("memory          peak RSS %.1f MiB, estimated %.1f MiB: %s\n", r.peak_rss_bytes / 1048576.0,
              r.memory_estimate_bytes / 1048576.0,
              memory_scope_text(s.mesh.world(), std::max<int>(1, (int)r.peak_rss_per_process.size())).c_str());
  for (size_t st = 0; st < r.pipeline.size(); ++st) {  // measured, per step after a warm-up step
    const MeshReport::Stage& p = r.pipeline[st];
    std::printf("%s stage %zu: busy %.1f of %.1f ms, bubble %.2f (formula %.2f), %d microbatches held, %.1f MiB "
                "activations%s\n",
                st == 0 ? "pipeline       " : "               ", st, p.busy_seconds * 1e3, p.step_seconds * 1e3,
                p.step_seconds > 0 ? 1.0 - p.busy_seconds / p.step_seconds : 0.0, r.pipeline_bubble_formula,
                p.peak_in_flight, p.workspace_bytes / 1048576.0, p.held ? ", held for the expert counts" : "");
  }
  for (size_t c = 0; c < r.context.size(); ++c) {  // measured, per step after a warm-up step
    const MeshReport::ContextRank& x = r.context[c];
    std::printf("%s rank %zu (%s): attention block %.1f ms, %.2f MiB sent (K/V %.2f MiB), %.1f MiB activations\n",
                c == 0 ? "context        " : "               ", c, r.mesh.cp_layout.c_str(), x.attention_seconds * 1e3,
                x.bytes_sent / 1048576.0, x.kv_bytes_sent / 1048576.0, x.workspace_bytes / 1048576.0);
  }
  std::printf("final_state_hash %s\n", r.final_state_hash.c_str());
}

// Settings that change nothing (Scenario::no_effect, and --progress beside
// --quiet): one warning each, from one process: rank 0 under mpirun.
void warn_no_effect(const Scenario& s, const RunArgs& a) {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (launched_by_mpirun() && rank && std::string(rank) != "0") return;
  std::vector<std::string> notes = s.no_effect;
  if (a.progress && a.quiet) notes.push_back("--progress has no effect with --quiet (no progress lines)");
  for (const std::string& n : notes) std::fprintf(stderr, "lockstep: warning: %s\n", n.c_str());
}

// The refusals the options and the scenario are enough for: made before
// mpirun or a supervisor starts anything.
void check_run_args(const RunArgs& a, const Scenario& s) {
  if (a.launcher != "threads" && a.launcher != "mpi")
    throw UserError("--launcher: 'threads' (ranks as threads of this process) or 'mpi' (one process per rank), got '" +
                    a.launcher + "'");
  // --steps stops a run early; it never stretches one past train.steps,
  // whose learning-rate schedule it keeps.
  if (a.steps == 0 || a.steps < -1) throw UserError("--steps: must be at least 1");
  if (a.steps > s.steps)
    throw UserError("--steps " + std::to_string(a.steps) + ": above train.steps = " + std::to_string(s.steps) +
                    " (--steps stops a run early, on train.steps' learning-rate schedule); set train.steps (--set "
                    "train.steps=" + std::to_string(a.steps) + ") to train longer");
  // The supervisor's settings, refused at once when they cannot mean anything:
  // a timeout of 0 or less would call every attempt hung.
  if (!(a.heartbeat_timeout > 0) || !std::isfinite(a.heartbeat_timeout))
    throw UserError("--heartbeat-timeout: must be a number of seconds above 0, got " + format_g(a.heartbeat_timeout));
  if (a.max_restarts < 0) throw UserError("--max-restarts: must be 0 or more, got " + std::to_string(a.max_restarts));
}

// The supervisor's children run `lockstep run` again with these options.
// Options a restarted child could not honour are refused, not dropped.
SuperviseOptions supervise_options(const RunArgs& a, const char* self) {
  SuperviseOptions so;
  so.binary = self;
  so.scenario = a.scenario;
  so.sets = a.sets;
  so.faults = a.faults;
  so.threads = a.threads;
  so.max_restarts = a.max_restarts;
  so.heartbeat_timeout = a.heartbeat_timeout;
  so.progress = !a.quiet && (a.progress || isatty(2));
  so.child_progress = so.progress;
  so.child_quiet = a.quiet;  // otherwise, on no terminal, progress at a log's cadence (from rank 0 under mpi)
  so.resume = a.resume;
  so.launcher = a.launcher;
  if (a.steps > 0) so.extra_args = {"--steps", std::to_string(a.steps)};
  if (a.progress_log.size() == 2)
    so.extra_args.insert(so.extra_args.end(), {"--progress-log-seconds", std::to_string(a.progress_log[0]) + "," +
                                                                            std::to_string(a.progress_log[1])});
  if (!a.backend.empty() && a.backend != "engine") {
    // The children train on it; the reference saves no checkpoint to restart from.
    if (parse_backend(a.backend) == Backend::kReference)
      throw UserError("--supervise: the reference backend saves no checkpoints; use engine or cuda-emulated");
    so.extra_args.insert(so.extra_args.end(), {"--backend", a.backend});
  }
  return so;
}

// A supervised run's summary: what ran, as an unsupervised summary says it
// (the last attempt's mesh and launcher), after its attempts and restarts.
void print_supervised_summary(const nlohmann::json& summary, const Scenario& s) {
  const size_t n = summary["restarts"].size();
  const nlohmann::json& losses = summary["losses"];
  std::printf("supervised      %d attempt%s, %zu restart%s\n", summary.value("attempts", 1),
              summary.value("attempts", 1) == 1 ? "" : "s", n, n == 1 ? "" : "s");
  const int threads = summary.value("threads", 1);
  std::printf("scenario        %s (%s backend, %d thread%s)\n", summary.value("scenario", s.name).c_str(),
              summary.value("backend", "engine").c_str(), threads, threads == 1 ? "" : "s");
  std::printf("model           d_model %d, %d layers, %d heads, %d experts top-%d, seq %d, batch %d\n",
              s.model.d_model, s.model.n_layers, s.model.n_heads, s.model.experts, s.model.top_k, s.model.seq_len,
              s.batch);
  if (summary.value("mesh_text", "one rank") != "one rank")  // as unsupervised: none on one rank
    std::printf("mesh            %s\n", summary.value("mesh_text", "").c_str());
  std::printf("launcher        %s\n",
              launcher_line(summary.value("launcher", "threads"), summary.value("processes", 1),
                            mesh_from_json(summary.value("mesh", mesh_json(s.mesh, s.microbatches))).world())
                  .c_str());
  if (!losses.empty())
    std::printf("loss            %.4f -> %.4f nats/byte over steps %d-%d\n", losses.front().get<double>(),
                losses.back().get<double>(), summary.value("losses_first_step", 1), summary.value("steps", 0));
  for (const auto& e : summary["evals"])
    std::printf("held-out        step %-6d %.4f bits/byte\n", e["step"].get<int>(), e["bpb"].get<double>());
  if (summary.value("already_complete", false))
    std::printf("resumed         the checkpoint of step %d is the final step: nothing was left to run\n",
                summary.value("steps", 0));
  std::printf("speed           %.0f tokens/s over %lld steps run (replays included)\n",
              summary.value("tokens_per_second", 0.0), (long long)summary.value("steps_run", 0));
  std::printf("final_state_hash %s\n", summary.value("final_state_hash", "").c_str());
}

// The supervisor: this process runs the job as children and restarts them
// from its checkpoints; the job's exit code is this one's.
int run_supervised(const RunArgs& a, const Scenario& s, const char* self) {
  for (const auto& [given, name] : std::vector<std::pair<bool, const char*>>{
           {!a.trace.empty(), "--trace"}, {!a.trace_dump.empty(), "--trace-dump"},
           {!a.debug_reorder.empty(), "--debug-reorder"}, {!a.debug_bumps.empty(), "--debug-bump"},
           {!a.debug_mesh_fault.empty(), "--debug-mesh-fault"},
           {a.dry_run, "--dry-run"}})
    if (given)
      throw UserError(std::string(name) + ": not available in a supervised run (--supervise or --fault): a restarted "
                      "child would start it over; use it in an unsupervised run");
  if (!a.out_dir.empty()) check_output_dir(a.out_dir);
  SuperviseResult r = supervise(supervise_options(a, self));
  if (!r.error.empty()) std::fprintf(stderr, "lockstep: error: %s\n", r.error.c_str());
  if (r.exit_code == 0 && !a.out_dir.empty()) {
    write_file_atomic((fs::path(a.out_dir) / "summary.json").string(), r.summary.dump(2) + "\n");
    write_file_atomic((fs::path(a.out_dir) / "scenario.resolved.json").string(), s.resolved.dump(2) + "\n");
  }
  if (a.json) {
    std::printf("%s\n", r.summary.dump().c_str());
  } else if (r.exit_code == 0) {
    print_supervised_summary(r.summary, s);
  }
  for (const auto& c : r.summary.value("corrupt_checkpoints", nlohmann::json::array()))
    std::fprintf(stderr, "lockstep: warning: the committed checkpoint of step %lld is left corrupt (%s: %s)\n",
                 (long long)c.value("step", 0), c.value("key", "").c_str(), c.value("why", "").c_str());
  if (!a.json && r.exit_code == 0 && !r.summary.value("corrupt_checkpoints", nlohmann::json::array()).empty())
    std::printf("corrupt         %zu committed checkpoint object(s) left corrupt (see corrupt_checkpoints in --json)\n",
                r.summary["corrupt_checkpoints"].size());
  return r.exit_code;
}

// Under mpirun: one mesh rank per process; rank 0 alone reports.
bool reports(const RunOptions& opt) { return !opt.mpi || opt.mpi->rank() == 0; }

// The options of a run in this process (a supervised child's included).
RunOptions in_process_options(const RunArgs& a, const Scenario& s, const std::vector<FaultSpec>& faults, bool child) {
  RunOptions opt;
  opt.backend = parse_backend(a.backend);
  opt.threads = a.threads;
  if (launched_by_mpirun()) opt.mpi = &mpi_world();
  const bool report = reports(opt);
  // More threads than cores gives the same bits, only slower: say so once (rank 0 under mpirun).
  if (a.threads > omp_get_num_procs() && report && !a.quiet && !child && opt.backend == Backend::kEngine)
    std::fprintf(stderr,
                 "lockstep: warning: --threads %d is more than the %d core%s this process may use%s; the bits are "
                 "the same, but expect it to run slower than --threads %d\n",
                 a.threads, omp_get_num_procs(), omp_get_num_procs() == 1 ? "" : "s",
                 opt.mpi ? " (--threads is per process; mpirun binds each to its cores)" : "", omp_get_num_procs());
  opt.steps = a.steps;
  opt.hash_at = a.hash_at;
  // --quiet wins over --progress (warn_no_effect says so). Not a terminal:
  // a CI log's cadence, a line in the first seconds then at most every 30 s.
  opt.progress = report && !a.quiet && (a.progress || isatty(2));
  opt.progress_log.on = report && !a.quiet && !opt.progress;
  if (a.progress_log.size() == 2) {
    opt.progress_log.first = a.progress_log[0];
    opt.progress_log.every = a.progress_log[1];
  }
  opt.trace_path = a.trace;
  opt.resume = a.resume;
  opt.resume_fallback_to_start = a.resume_fallback_to_start;
  opt.faults = faults;
  opt.fault_state = a.fault_state;
  opt.heartbeat = a.heartbeat;
  opt.step_log = a.step_log;
  opt.lease = a.lease;
  opt.lease_wait = !a.resume.empty();  // an explicit --resume waits out a dead job's lease
  opt.profile_ops = a.profile_ops;
  if (child) opt.fired = read_fault_state(a.fault_state).indices;
  if (!a.trace_dump.empty()) {
    if (a.trace.empty()) throw UserError("--trace-dump needs --trace FILE");
    opt.trace_dump = DumpSpec::parse(a.trace_dump, a.steps > 0 ? a.steps : s.steps);
  }
  if (!a.debug_reorder.empty()) {
    if (a.debug_reorder != "moe_norm") throw UserError("--debug-reorder: only 'moe_norm' exists");
    opt.debug_reorder_moe_norm = true;
  }
  for (const std::string& b : a.debug_bumps) opt.debug_bumps.push_back(parse_bump(b));
  opt.debug_mesh_fault = a.debug_mesh_fault;
  return opt;
}

// Trains in this process: every rank a thread of it, or one rank of an
// mpirun job. Writes --out, prints the summary (--json: one object).
int run_in_process(const RunArgs& a, const Scenario& s, const std::vector<FaultSpec>& faults, bool child) {
  const RunOptions opt = in_process_options(a, s, faults, child);
  if (!a.out_dir.empty()) check_output_dir(a.out_dir);
  RunResult r = run_scenario(s, opt);
  if (!reports(opt)) return 0;
  nlohmann::json j = result_json(r);
  const std::string launcher = opt.mpi ? "mpi" : "threads";
  const int processes = opt.mpi ? opt.mpi->size() : 1;
  j["launcher"] = launcher;
  j["processes"] = processes;
  if (!a.out_dir.empty()) {
    fs::create_directories(a.out_dir);
    write_file_atomic((fs::path(a.out_dir) / "summary.json").string(), j.dump(2) + "\n");
    write_file_atomic((fs::path(a.out_dir) / "scenario.resolved.json").string(), s.resolved.dump(2) + "\n");
  }
  if (a.json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    print_summary(r, s, launcher, processes);
  }
  return 0;
}

}  // namespace

int cmd_run(const RunArgs& a, const char* self) {
  // A supervised child (every rank of one) ends the moment its supervisor
  // does, however the supervisor ends; its scratch directory goes with it.
  if (a.supervisor_pid > 0)
    watch_supervisor(a.supervisor_pid,
                     a.heartbeat.empty() ? nullptr : fs::path(a.heartbeat).parent_path().string().c_str());
  Scenario s = load_scenario(a.scenario, a.sets);
  check_run_args(a, s);
  const std::vector<FaultSpec> faults = planned_faults(s, a.faults, a.steps);
  const bool child = !a.fault_state.empty();
  const bool supervised = !child && (a.supervise || !faults.empty());
  if (supervised && launched_by_mpirun())
    throw UserError("--supervise / --fault under mpirun: the supervisor must stand outside the job to restart it; "
                    "run `lockstep run ... --launcher mpi --supervise` (it starts mpirun itself)");
  // --launcher mpi: this process becomes mpirun, or (supervised) the supervisor starts it per attempt.
  const bool starts_mpirun = a.launcher == "mpi" && !launched_by_mpirun() && !a.dry_run && !supervised;
  if (!child && !starts_mpirun) warn_no_effect(s, a);  // its ranks say it (rank 0), or this process
  if (starts_mpirun) launch_under_mpirun(s, self);
  if (a.dry_run) {
    RunOptions po;
    po.backend = parse_backend(a.backend);
    po.threads = a.threads;
    po.resume = a.resume;
    return print_memory_plan(s, po, a.json, a.launcher == "mpi");
  }
  if (supervised) return run_supervised(a, s, self);
  return run_in_process(a, s, faults, child);
}

Command run_command(CLI::App& cmd) {
  auto args = std::make_shared<RunArgs>();
  RunArgs& ra = *args;
  CLI::App* run = &cmd;
  run->add_option("scenario", ra.scenario, "scenario JSON file")->required();
  run->add_option("--set", ra.sets, "override a scenario key: dotted.key=value (repeatable)");
  run->add_option("--threads", ra.threads,
                  "worker threads (default: all cores); the engine runs them as data lanes of whole samples where "
                  "the bits allow, else splits each op (README, Speed)")
      ->check(CLI::Range(1, 1024));
  run->add_option("--backend", ra.backend,
                  "engine (fast), reference (scalar spec), cuda-emulated (the CUDA kernels run on the CPU through "
                  "an emulation of CUDA: slow, for checking the kernels' bits) or cuda (the kernels on a GPU)");
  run->add_option("--hash-at", ra.hash_at, "(set by lockstep check: record the state hash after these steps)")
      ->delimiter(',')
      ->group("");
  run->add_option("--progress-log-seconds", ra.progress_log,
                  "(tests: FIRST,EVERY seconds of the progress lines when stderr is not a terminal; default 5,30)")
      ->delimiter(',')
      ->expected(2)
      ->group("");
  run->add_option("--launcher", ra.launcher,
                  "threads (default: every rank a thread of this process) or mpi (starts mpirun -np mesh.dp x "
                  "mesh.tp x mesh.pp x mesh.cp, one process per rank; docs/CLUSTER.md)");
  run->add_option("--steps", ra.steps,
                  "stop after this many steps (at most train.steps); the learning-rate schedule stays train.steps' "
                  "(so a run stopped early matches the full run's first N steps bit for bit, and its checkpoints "
                  "resume it)");
  run->add_option("--out", ra.out_dir, "write summary.json and scenario.resolved.json here");
  run->add_flag("--json", ra.json, "print the summary as one JSON object on the last line of stdout");
  run->add_flag("--progress", ra.progress, "progress lines on stderr even when it is not a terminal");
  run->add_flag("--quiet", ra.quiet, "no progress lines");
  run->add_flag("--dry-run", ra.dry_run,
                "print the memory estimate per part (as `plan`) and train nothing; exit 5 when it does not fit");
  run->add_flag("--profile-ops", ra.profile_ops,
                "time each kind of op (GEMM, weight gradients, attention, softmax, norms, MoE dispatch and combine, "
                "AdamW, gradient norm, copies for collectives and chains): op_seconds in the --json summary, "
                "thread-seconds over the training steps");
  run->add_option("--resume", ra.resume,
                  "continue from the latest committed checkpoint at URL (or URL@STEP), on this run's mesh; an "
                  "unusable one falls back to the one before; none usable: exit 2 (never a silent restart from step "
                  "0); already at the final step: exit 0, nothing left to run");
  run->add_option("--fault", ra.faults,
                  "inject a fault: KIND@STEP[:key=value,...] (docs/FAULTS.md); runs supervised (repeatable)");
  run->add_flag("--supervise", ra.supervise,
                "run as a supervised child process, restarted from checkpoints on failure");
  run->add_option("--max-restarts", ra.max_restarts,
                  "supervisor: restart budget, 0 or more (default 8; exhausted: exit 1)");
  run->add_option("--heartbeat-timeout", ra.heartbeat_timeout,
                  "supervisor: seconds above 0 without a new step that count as a hang (default 120)");
  run->add_option("--fault-state", ra.fault_state, "(set by the supervisor for its child)")->group("");
  run->add_option("--heartbeat", ra.heartbeat, "(set by the supervisor for its child)")->group("");
  run->add_option("--step-log", ra.step_log, "(set by the supervisor for its child)")->group("");
  run->add_option("--supervisor-pid", ra.supervisor_pid, "(set by the supervisor for its child)")->group("");
  run->add_option("--lease", ra.lease, "(set by the supervisor for its child)")->group("");
  run->add_flag("--resume-fallback-start", ra.resume_fallback_to_start, "(set by the supervisor for its child)")
      ->group("");
  run->add_option("--trace", ra.trace, "write a per-op trace (JSON Lines, docs/TRACE.md) to this file");
  run->add_option("--trace-dump", ra.trace_dump, "keep full tensors in the trace for STEP or STEP:OP");
  run->add_option("--debug-reorder", ra.debug_reorder,
                  "debug only: break the contract in one op (moe_norm) so drift tools can be tested")
      ->group("Debug");
  run->add_option("--debug-bump", ra.debug_bumps, "debug only: PARAM[INDEX]@STEP adds one ulp to a weight")
      ->group("Debug");
  run->add_option("--debug-mesh-fault", ra.debug_mesh_fault,
                  "debug only: one piece of the mesh machinery flips one bit a step (tp_chain, cp_handoff, "
                  "pp_activation, ep_row, fsdp_block) so drift tools can be tested")
      ->group("Debug");
  return [args] { return cmd_run(*args, self_executable().c_str()); };
}

}  // namespace ls
