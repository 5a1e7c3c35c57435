// lockstep: the command line. Subcommands run, golden, check, keys.
// Exit codes: 0 ok, 1 a check found different bits, 2 bad input, 5 plan /
// --dry-run: the plan does not fit in the memory available.
#include <fcntl.h>
#include <omp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "cli/bisect.h"
#include "cli/failure.h"
#include "cli/self_exe.h"
#include "cli/faults_sweep.h"
#include "cli/junit.h"
#include "cluster/mpi.h"
#include "contract.h"
#include "common/error.h"
#include "common/stop_signals.h"
#include "common/json_input.h"
#include "common/text.h"
#include "ckpt/checkpointer.h"
#include "ckpt/gc.h"
#include "ckpt/lease.h"
#include "runner/lifeline.h"
#include "runner/golden.h"
#include "runner/memory_plan.h"
#include "runner/supervisor.h"
#include "faults/fault_spec.h"
#include "faults/injector.h"
#include "store/store.h"
#include "runner/runner.h"
#include "runner/scenario.h"
#include "trace/diff.h"
#include "trace/report.h"

namespace fs = std::filesystem;
using namespace ls;

namespace {

nlohmann::json read_json_file(const std::string& path) {
  return parse_untrusted_json(read_file_limited(path, size_t(64) << 20), path);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) throw UserError(path + ": cannot write file");
    out << text;
    if (!out) throw UserError(path + ": write failed");
  }
  fs::rename(tmp, path);
}

// --out DIR must be a folder we can write, checked before any training: a
// plain file or a read-only folder is refused at once, with the OS's reason.
void check_output_dir(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) throw UserError("--out " + dir + ": exists and is not a folder");
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
  const nlohmann::json saved = r.restore.is_object() ? r.restore.value("saved_mesh", nlohmann::json()) : nlohmann::json();
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
    std::printf("numerics        local: %s; GEMMs by %s\n",
                launcher == "mpi" ? "the ranks' sums in the MPI library's order; not bitwise across threads or meshes"
                                  : "the same bits run to run at this thread count and mesh only",
                r.local_gemm.c_str());
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

struct RunArgs {
  std::string scenario;
  std::vector<std::string> sets;
  int threads = 0;
  std::string backend = "engine";
  int steps = -1;
  std::string out_dir;
  bool json = false, progress = false, quiet = false, dry_run = false, profile_ops = false;
  std::string trace, trace_dump, debug_reorder, resume;
  std::vector<std::string> faults;
  bool supervise = false;
  std::string fault_state, heartbeat, step_log;  // set by the supervisor for its child
  int supervisor_pid = 0;                        // the supervisor its child watches (runner/lifeline.h)
  std::string lease;                             // the supervisor's checkpoint lease, JOB:GENERATION
  bool resume_fallback_to_start = false;         // (the supervisor's restarts: RunOptions)
  int max_restarts = 8;
  double heartbeat_timeout = 120;
  std::vector<std::string> debug_bumps;
  std::string debug_mesh_fault;
  std::string launcher = "threads";
  std::vector<int> hash_at;  // (lockstep check --launcher mpi: the golden file's state-hash steps)
  std::vector<double> progress_log;  // (tests: FIRST,EVERY seconds of the not-a-terminal cadence)
};

// The command line as given, for --launcher mpi to hand to mpirun.
std::vector<std::string> g_args;

// --launcher mpi: runs `mpirun -np <world> lockstep ...` with the same
// arguments (less --launcher), one rank per process, and ends as it ends.
// mpirun stopped by a signal exits 1 without a word, and 1 means "found a
// difference" here; so the job runs in a session of its own (a terminal's
// Ctrl-C reaches this process alone), and a stop signal is handed on to
// every process of it, then this process says so in one line and dies of
// the signal, as the threads launcher and the supervisor do (130, 143).
[[noreturn]] void launch_under_mpirun(const Scenario& s, const char* self) {
  require_mpi("--launcher mpi");
  std::vector<std::string> cmd = mpirun_command(s.mesh.world());
  cmd.push_back(self);
  for (size_t i = 1; i < g_args.size(); ++i) {
    if (g_args[i] == "--launcher") {
      ++i;
      continue;
    }
    if (g_args[i].rfind("--launcher=", 0) == 0) continue;
    cmd.push_back(g_args[i]);
  }
  // A rank's stderr is mpirun's pipe, not this terminal: rank 0 would keep
  // to a log's cadence. At a terminal it shows progress as a threads run does.
  if (isatty(2) && std::find(g_args.begin(), g_args.end(), "--quiet") == g_args.end() &&
      std::find(g_args.begin(), g_args.end(), "--progress") == g_args.end())
    cmd.push_back("--progress");
  std::vector<char*> argv;
  for (std::string& c : cmd) argv.push_back(c.data());
  argv.push_back(nullptr);
  // Installed before the fork: a signal that comes while mpirun starts is
  // not lost. One the caller ignores (nohup) stays ignored.
  const StopSignals stop_signals;
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw UserError(std::string("--launcher mpi: cannot start mpirun: ") + std::strerror(errno));
  if (pid == 0) {
    ::setsid();
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // this process killed outright: mpirun ends its ranks
    if (::getppid() != parent) ::_exit(128 + SIGTERM);
    // Nothing reads stdin; mpirun would forward it to rank 0, from a terminal it no longer owns.
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::signal(sig, SIG_DFL);
    ::execvp(argv[0], argv.data());
    const std::string m = std::string("lockstep: error: --launcher mpi: cannot start mpirun: ") + std::strerror(errno) + "\n";
    (void)!::write(2, m.data(), m.size());
    ::_exit(2);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) != pid) {
    if (errno != EINTR) throw UserError(std::string("--launcher mpi: waiting for mpirun: ") + std::strerror(errno));
    const int sig = stop_signal();
    if (!sig) continue;
    const std::vector<int> procs = session_processes(pid);
    for (int p : procs) ::kill(p, sig);
    // The job gets 5 s to end, then whatever is left of it is killed.
    bool reaped = false;
    for (int i = 0; i < 500 && !reaped; ++i) {
      reaped = ::waitpid(pid, &status, WNOHANG) == pid;
      if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (int p : session_processes(pid)) ::kill(p, SIGKILL);
    if (!reaped) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    std::fprintf(stderr, "lockstep: %s: stopped the mpirun job (%zu process%s)%s\n", stop_signal_name(sig).c_str(),
                 procs.size(),
                 procs.size() == 1 ? "" : "es",
                 s.ckpt.url.empty() ? "" : ("; committed checkpoints in " + s.ckpt.url + " are intact (continue with --resume " + s.ckpt.url + ")").c_str());
    die_of_signal(sig);
  }
  std::fflush(nullptr);
  if (WIFSIGNALED(status)) std::_Exit(128 + WTERMSIG(status));
  std::_Exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}

// plan / run --dry-run: the memory estimate per part, nothing trained. Exits
// kExitDoesNotFit when the estimate exceeds the memory available, so that a
// script (or CI) can gate on it; 2 stays for bad input.
constexpr int kExitDoesNotFit = 5;

int cmd_plan(const Scenario& s, const RunOptions& opt, bool as_json, bool mpi) {
  // A resume's checkpoint must be there, as run --resume requires: a plan of
  // a mistyped path would count restore buffers for nothing.
  if (!opt.resume.empty()) {
    const auto [url, at] = split_checkpoint_url(opt.resume);
    try {
      read_manifest(*open_store(url, StoreOptions{s.ckpt.s3_endpoint}), at);
    } catch (const UserError& e) {
      throw UserError(std::string("--resume: ") + e.what());
    }
  }
  const MemoryEstimate e = estimate_run_memory(s, opt, mpi);  // mpi: one process's (the largest rank's)
  const uint64_t available = available_memory_bytes();
  const bool fits = !available || e.total_bytes * (uint64_t)e.processes <= available;
  if (as_json) {
    nlohmann::json j = memory_estimate_json(e, available);
    j["scenario"] = s.name;
    j["mesh"] = mesh_json(s.mesh, s.microbatches);
    j["mesh_text"] = s.mesh.describe(s.microbatches);
    j["launcher"] = mpi ? "mpi" : "threads";
    j["fits"] = fits;
    std::printf("%s\n", j.dump().c_str());
  } else {
    // The mesh as every tool prints it (MeshConfig::describe), and its world.
    std::printf("scenario %s: d_model %d, %d layers, %d experts top-%d, batch %d x seq %d, mesh %s%s\n",
                s.name.c_str(), s.model.d_model, s.model.n_layers, s.model.experts, s.model.top_k, s.batch,
                s.model.seq_len, s.mesh.describe(s.microbatches).c_str(),
                s.mesh.world() > 1 ? (" (" + std::to_string(s.mesh.world()) + " ranks)").c_str() : "");
    std::printf("%s", format_memory_estimate(e, available).c_str());
    if (!fits) std::printf("does not fit: `lockstep run` would refuse it (plan exits %d)\n", kExitDoesNotFit);
  }
  return fits ? 0 : kExitDoesNotFit;
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

int cmd_run(const RunArgs& a, const char* self) {
  // A supervised child (every rank of one) ends the moment its supervisor
  // does, however the supervisor ends; its scratch directory goes with it.
  if (a.supervisor_pid > 0)
    watch_supervisor(a.supervisor_pid,
                     a.heartbeat.empty() ? nullptr : fs::path(a.heartbeat).parent_path().string().c_str());
  Scenario s = load_scenario(a.scenario, a.sets);
  if (a.launcher != "threads" && a.launcher != "mpi")
    throw UserError("--launcher: 'threads' (ranks as threads of this process) or 'mpi' (one process per rank), got '" +
                    a.launcher + "'");
  // --steps stops a run early; it never stretches one past train.steps,
  // whose learning-rate schedule it keeps. Refused here, before mpirun or a
  // supervisor starts anything.
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
    return cmd_plan(s, po, a.json, a.launcher == "mpi");
  }
  if (supervised) {
    // The supervisor: this process runs the job as children and restarts them.
    // Options a restarted child could not honour are refused, not dropped.
    for (const auto& [given, name] : std::vector<std::pair<bool, const char*>>{
             {!a.trace.empty(), "--trace"}, {!a.trace_dump.empty(), "--trace-dump"},
             {!a.debug_reorder.empty(), "--debug-reorder"}, {!a.debug_bumps.empty(), "--debug-bump"},
             {!a.debug_mesh_fault.empty(), "--debug-mesh-fault"},
             {a.dry_run, "--dry-run"}})
      if (given)
        throw UserError(std::string(name) + ": not available in a supervised run (--supervise or --fault): a restarted "
                        "child would start it over; use it in an unsupervised run");
    if (!a.out_dir.empty()) check_output_dir(a.out_dir);
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
    SuperviseResult r = supervise(so);
    if (!r.error.empty()) std::fprintf(stderr, "lockstep: error: %s\n", r.error.c_str());
    if (r.exit_code == 0 && !a.out_dir.empty()) {
      write_file_atomic((fs::path(a.out_dir) / "summary.json").string(), r.summary.dump(2) + "\n");
      write_file_atomic((fs::path(a.out_dir) / "scenario.resolved.json").string(), s.resolved.dump(2) + "\n");
    }
    if (a.json) {
      std::printf("%s\n", r.summary.dump().c_str());
    } else if (r.exit_code == 0) {
      const size_t n = r.summary["restarts"].size();
      const nlohmann::json& losses = r.summary["losses"];
      std::printf("supervised      %d attempt%s, %zu restart%s\n", r.summary.value("attempts", 1),
                  r.summary.value("attempts", 1) == 1 ? "" : "s", n, n == 1 ? "" : "s");
      // What ran, as an unsupervised summary says it: the last attempt's mesh and launcher.
      const int threads = r.summary.value("threads", 1);
      std::printf("scenario        %s (%s backend, %d thread%s)\n", r.summary.value("scenario", s.name).c_str(),
                  r.summary.value("backend", "engine").c_str(), threads, threads == 1 ? "" : "s");
      std::printf("model           d_model %d, %d layers, %d heads, %d experts top-%d, seq %d, batch %d\n",
                  s.model.d_model, s.model.n_layers, s.model.n_heads, s.model.experts, s.model.top_k,
                  s.model.seq_len, s.batch);
      if (r.summary.value("mesh_text", "one rank") != "one rank")  // as unsupervised: none on one rank
        std::printf("mesh            %s\n", r.summary.value("mesh_text", "").c_str());
      std::printf("launcher        %s\n",
                  launcher_line(r.summary.value("launcher", "threads"), r.summary.value("processes", 1),
                                mesh_from_json(r.summary.value("mesh", mesh_json(s.mesh, s.microbatches))).world())
                      .c_str());
      if (!losses.empty())
        std::printf("loss            %.4f -> %.4f nats/byte over steps %d-%d\n", losses.front().get<double>(),
                    losses.back().get<double>(), r.summary.value("losses_first_step", 1),
                    r.summary.value("steps", 0));
      for (const auto& e : r.summary["evals"])
        std::printf("held-out        step %-6d %.4f bits/byte\n", e["step"].get<int>(), e["bpb"].get<double>());
      if (r.summary.value("already_complete", false))
        std::printf("resumed         the checkpoint of step %d is the final step: nothing was left to run\n",
                    r.summary.value("steps", 0));
      std::printf("speed           %.0f tokens/s over %lld steps run (replays included)\n",
                  r.summary.value("tokens_per_second", 0.0), (long long)r.summary.value("steps_run", 0));
      std::printf("final_state_hash %s\n", r.summary.value("final_state_hash", "").c_str());
    }
    for (const auto& c : r.summary.value("corrupt_checkpoints", nlohmann::json::array()))
      std::fprintf(stderr, "lockstep: warning: the committed checkpoint of step %lld is left corrupt (%s: %s)\n",
                   (long long)c.value("step", 0), c.value("key", "").c_str(), c.value("why", "").c_str());
    if (!a.json && r.exit_code == 0 && !r.summary.value("corrupt_checkpoints", nlohmann::json::array()).empty())
      std::printf("corrupt         %zu committed checkpoint object(s) left corrupt (see corrupt_checkpoints in --json)\n",
                  r.summary["corrupt_checkpoints"].size());
    return r.exit_code;
  }
  RunOptions opt;
  opt.backend = parse_backend(a.backend);
  opt.threads = a.threads;
  // Under mpirun: one mesh rank per process; rank 0 alone reports.
  bool report = true;
  if (launched_by_mpirun()) {
    opt.mpi = &mpi_world();
    report = opt.mpi->rank() == 0;
  }
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
  if (!a.out_dir.empty()) check_output_dir(a.out_dir);
  RunResult r = run_scenario(s, opt);
  if (!report) return 0;
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

struct GoldenArgs {
  std::vector<std::string> scenarios;
  std::string golden_dir = "golden";
  bool no_reference = false;
  int threads = 0;
};

int cmd_golden(const GoldenArgs& a) {
  fs::create_directories(a.golden_dir);
  for (const std::string& path : a.scenarios) {
    Scenario s = load_scenario(path, {});
    if (!golden_refusal(s.level).empty()) throw UserError(path + ": " + golden_refusal(s.level));
    RunOptions opt;
    opt.threads = a.threads;
    opt.hash_at = golden_hash_steps(s.steps);
    opt.eval = false;
    opt.progress = isatty(2);  // the reference cross-check takes minutes
    std::fprintf(stderr, "golden %s: engine, %d steps\n", s.name.c_str(), s.steps);
    RunResult r = run_scenario(s, opt);
    nlohmann::json g = make_golden(path, r);
    if (!a.no_reference) {
      // An independent path: the scalar reference must produce the same bits.
      std::fprintf(stderr, "golden %s: reference cross-check, %d steps\n", s.name.c_str(), s.steps);
      opt.backend = Backend::kReference;
      RunResult rr = run_scenario(s, opt);
      std::string diff = compare_golden(g, rr);
      if (!diff.empty()) {
        std::fprintf(stderr, "golden %s: engine and reference disagree, not written: %s\n", s.name.c_str(),
                     diff.c_str());
        return 1;
      }
      g["reference_checked"] = true;
    }
    const std::string out = (fs::path(a.golden_dir) / (s.name + ".json")).string();
    write_file_atomic(out, g.dump(2) + "\n");
    std::printf("wrote %s (final_state_hash %s)\n", out.c_str(), r.final_state_hash.c_str());
  }
  return 0;
}

struct CheckArgs {
  std::vector<std::string> scenarios;
  std::string golden_dir = "golden";
  std::string scenario_dir;  // --scenario-dir: the golden files' scenarios (default: beside golden_dir)
  int threads = 0;
  std::string backend = "engine";
  std::string launcher = "threads";
  bool json = false;  // one JSON object on stdout instead of the lines
  std::string junit;  // write JUnit XML here
};

// What `check` found for one scenario, for --json and --junit.
struct CheckOutcome {
  nlohmann::json results = nlohmann::json::array();
  std::vector<JUnitCase> cases;

  void add(const Scenario& s, const std::string& spath, const std::string& gpath, double seconds,
           const GoldenMismatch& m, nlohmann::json detail) {
    detail["name"] = s.name;
    detail["scenario"] = spath;
    detail["golden"] = gpath;
    detail["ok"] = !m.differs();
    detail["seconds"] = seconds;
    detail["failure"] = m.differs() ? m.to_json() : nlohmann::json(nullptr);
    results.push_back(std::move(detail));
    JUnitCase c;
    c.classname = "lockstep.check." + s.name;
    c.name = fs::path(spath).filename().string();
    c.seconds = seconds;
    if (m.differs()) {
      c.failed = true;
      c.failure_type = m.field;
      c.failure_message = m.message;
      c.failure_text = (m.step ? "step: " + std::to_string(m.step) + "\n" : std::string()) + "field: " + m.field +
                       "\ngolden: " + m.golden + "\nnow: " + m.now + "\ngolden file: " + gpath +
                       "\nscenario: " + spath + "\n";
    }
    cases.push_back(std::move(c));
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A mesh variant run as `mpirun -np <world> lockstep run` (check --launcher
// mpi): its summary, as the RunResult compare_golden reads. Throws UserError
// with the child's stderr when it fails.
RunResult run_under_mpirun(const std::string& spath, const Scenario& s, int threads) {
  char tmpl[] = "/tmp/lockstep-check-mpi-XXXXXX";
  if (!mkdtemp(tmpl)) throw UserError("check: cannot create a temporary directory");
  const std::string dir = tmpl;
  std::string cmd;
  for (const std::string& w : mpirun_command(s.mesh.world())) cmd += w + " ";
  cmd += "'" + self_executable() + "' run '" + spath + "' --json --quiet --hash-at ";
  std::string steps;
  for (int h : golden_hash_steps(s.steps)) steps += (steps.empty() ? "" : ",") + std::to_string(h);
  cmd += steps.empty() ? "0" : steps;
  if (threads > 0) cmd += " --threads " + std::to_string(threads);
  cmd += " >" + dir + "/out 2>" + dir + "/err";
  const int status = std::system(cmd.c_str());
  std::ifstream out(dir + "/out"), err(dir + "/err");
  const std::string text((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>()),
      etext((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  fs::remove_all(dir);
  if (status != 0) throw UserError("mpirun of " + spath + " failed: " + etext);
  const size_t end = text.find_last_not_of('\n'), nl = text.rfind('\n', end);
  const nlohmann::json j = nlohmann::json::parse(text.substr(nl == std::string::npos ? 0 : nl + 1));
  RunResult r;
  r.fingerprint = j.at("fingerprint");
  r.level = j.value("level", "portable");
  r.steps = j.at("steps");
  r.threads = j.value("threads", threads);
  for (const auto& b : j.at("loss_bits")) {
    r.losses.push_back(from_bits((uint32_t)std::stoul(b.get<std::string>(), nullptr, 16)));
  }
  for (auto& [k, v] : j.at("state_hashes").items()) r.state_hashes[std::stoi(k)] = v.get<std::string>();
  r.final_state_hash = j.at("final_state_hash");
  return r;
}

// Units in the last place between two fp32 values written as their hex
// bits ("409aaa3f"): the size of a change the decimals may not show. -1
// when either is not such a value.
int64_t ulp_distance(const std::string& a, const std::string& b) {
  auto ordered = [](const std::string& hex) -> int64_t {  // monotonic in the value
    if (hex.size() != 8 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) return INT64_MIN;
    const uint32_t u = (uint32_t)std::stoul(hex, nullptr, 16);
    return (u & 0x80000000u) ? -(int64_t)(u & 0x7fffffffu) : (int64_t)u;
  };
  const int64_t x = ordered(a), y = ordered(b);
  return x == INT64_MIN || y == INT64_MIN ? -1 : std::llabs(x - y);
}

// A failing check's next step: how far apart the bits are (added to the
// message) and the command that finds out why. A mesh variant against its
// twin: bisect (which of the two moved the bits, and where); the golden
// scenario itself: the commit since the golden file was written.
struct NextStep {
  int64_t ulps = -1;
  std::string command;  // empty: none to suggest (the run failed, the fingerprint moved, ...)
  nlohmann::json json_ulps() const { return ulps >= 0 ? nlohmann::json(ulps) : nlohmann::json(nullptr); }
  nlohmann::json json_command() const { return command.empty() ? nlohmann::json(nullptr) : nlohmann::json(command); }
};
NextStep next_step(GoldenMismatch& m, const nlohmann::json& g, const std::string& spath, const std::string& gpath,
                   const std::string& golden_dir) {
  NextStep n;
  if (m.field == "loss_bits" && (n.ulps = ulp_distance(m.golden, m.now)) >= 0)
    m.message += ", " + std::to_string(n.ulps) + " ulp" + (n.ulps == 1 ? "" : "s") + " apart";
  if (m.field != "loss_bits" && m.field != "state_hash" && m.field != "final_state_hash") return n;
  const fs::path twin = g.value("scenario", "");
  if (!twin.empty() && twin.filename() != fs::path(spath).filename()) {
    // Recorded from the repository's root, read from the golden folder's parent (as check reads it).
    const fs::path at = twin.is_absolute() ? twin : fs::absolute(golden_dir).parent_path() / twin;
    n.command = "lockstep bisect " + (fs::exists(at) && !twin.is_absolute() ? at.lexically_relative(fs::current_path())
                                                                             : twin).string() +
                " " + spath;
  } else {
    n.command = "tools/bisect-commits $(git log -1 --format=%h -- " + gpath + ") HEAD " + spath;
  }
  return n;
}

int cmd_check(const CheckArgs& a) {
  if (a.launcher != "threads" && a.launcher != "mpi")
    throw UserError("--launcher: 'threads' or 'mpi', got '" + a.launcher + "'");
  if (a.launcher == "mpi") require_mpi("--launcher mpi");
  const Backend backend = parse_backend(a.backend);  // a bad name is refused before anything runs
  // What to run: (golden file, scenario path, the golden's name).
  struct Work {
    std::string gpath, spath, name;
  };
  // Options first: a path that cannot be written is refused before any file is read.
  if (!a.junit.empty()) check_junit_path(a.junit);
  std::vector<Work> work;
  if (a.scenarios.empty()) {
    if (!fs::is_directory(a.golden_dir)) throw UserError(a.golden_dir + ": no golden directory");
    std::vector<std::string> files;
    for (auto& e : fs::directory_iterator(a.golden_dir))
      if (e.path().extension() == ".json") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    if (files.empty()) throw UserError(a.golden_dir + ": no golden files");
    // A golden file records its scenario as `lockstep golden` was given it
    // (scenarios/top2.json, from the repository's root), so by default it is
    // read from the golden folder's parent: golden/ and scenarios/ side by
    // side, as in the repository. --scenario-dir DIR names the folder of the
    // scenarios instead (DIR/top2.json, DIR/variants, DIR/faults), for a
    // golden folder kept elsewhere.
    const bool given_dir = !a.scenario_dir.empty();
    if (given_dir && !fs::is_directory(a.scenario_dir))
      throw UserError("--scenario-dir " + a.scenario_dir + ": no such folder");
    const fs::path root = fs::absolute(a.golden_dir).parent_path();
    const fs::path sdir = given_dir ? fs::path(a.scenario_dir) : root / "scenarios";
    // Mesh variants (scenarios/variants/*.json) and fault scenarios
    // (scenarios/faults/*.json) are held to their twin's golden file, found by
    // the variant's name.
    std::map<std::string, std::vector<std::string>> variants;
    for (const char* sub : {"variants", "faults"}) {
      const fs::path vdir = sdir / sub;
      if (!fs::is_directory(vdir)) continue;
      std::vector<std::string> vfiles;
      for (auto& e : fs::directory_iterator(vdir))
        if (e.path().extension() == ".json") vfiles.push_back(e.path().string());
      std::sort(vfiles.begin(), vfiles.end());
      for (auto& v : vfiles) variants[load_scenario(v, {}).name].push_back(v);
    }
    for (auto& f : files) {
      const nlohmann::json g = read_json_file(f);
      const auto recorded = g.find("scenario");
      if (recorded == g.end() || !recorded->is_string() || recorded->get<std::string>().empty())
        throw UserError(f + ": golden field 'scenario' must be the scenario's path (a string)");
      const fs::path rec = recorded->get<std::string>();
      const fs::path spath = given_dir ? sdir / rec.filename() : root / rec;
      // Name the paths the user gave: the golden file (under --golden-dir) or --scenario-dir.
      if (!fs::exists(spath)) {
        if (given_dir)
          throw UserError("--scenario-dir " + a.scenario_dir + ": " + spath.string() + " not found (the scenario of " +
                          f + ", which names " + rec.string() + ")");
        throw UserError(f + ": its scenario " + rec.string() + " is read from the golden folder's parent, and " +
                        spath.string() + " does not exist; give the folder of the scenarios with --scenario-dir DIR");
      }
      const std::string name = g.value("name", fs::path(f).stem().string());
      work.push_back({f, spath.string(), name});
      for (auto& v : variants[name]) work.push_back({f, v, name});
    }
  } else {
    if (!a.scenario_dir.empty())  // not silently unused
      throw UserError("--scenario-dir " + a.scenario_dir + ": only without scenario files (it says where the golden "
                      "files' scenarios are); the files given are the scenarios");
    for (auto& sc : a.scenarios) {
      Scenario s = load_scenario(sc, {});
      const std::string gpath = (fs::path(a.golden_dir) / (s.name + ".json")).string();
      if (!fs::exists(gpath))  // what to run instead, not only what is missing
        throw UserError(gpath + ": no golden file for " + sc + " (scenario name '" + s.name +
                        "'); write one with `lockstep golden " + sc +
                        (a.golden_dir == "golden" ? std::string() : " --golden-dir " + a.golden_dir) +
                        "`, which checks the engine against the scalar reference first");
      work.push_back({gpath, sc, s.name});
    }
  }
  CheckOutcome outcome;
  int failed = 0;
  const bool tty = isatty(2);  // a long check shows which scenario runs
  // The columns (name, scenario file) as wide as their longest entry, so
  // that a long variant's file name does not push its line out of step.
  int name_w = 4, file_w = 8;
  for (const Work& w : work) {
    name_w = std::max(name_w, (int)w.name.size());
    file_w = std::max(file_w, (int)fs::path(w.spath).filename().string().size());
  }
  if (!a.json) {
    // Which backend and launcher gave these bits, and against what.
    std::printf("check: backend %s, launcher %s, %zu scenario%s, golden files in %s", backend_name(backend),
                a.launcher.c_str(), work.size(), work.size() == 1 ? "" : "s", a.golden_dir.c_str());
    if (!a.scenario_dir.empty() && a.scenarios.empty()) std::printf(", scenarios in %s", a.scenario_dir.c_str());
    std::printf("\n");
    std::fflush(stdout);
  }
  size_t index = 0;
  for (const Work& w : work) {
    const std::string& gpath = w.gpath;
    const std::string& spath = w.spath;
    const std::string file = fs::path(spath).filename().string();
    ++index;
    const auto t0 = std::chrono::steady_clock::now();
    if (tty) std::fprintf(stderr, "check [%zu/%zu] %s\n", index, work.size(), fs::path(spath).filename().c_str());
    nlohmann::json g = read_json_file(gpath);
    Scenario s = load_scenario(spath, {});
    if (!s.faults.empty()) {
      // A fault scenario: supervised, restarted from checkpoints; it must end
      // on its fault-free twin's final hash.
      char tmpl[] = "/tmp/lockstep-check-XXXXXX";
      if (!mkdtemp(tmpl)) throw UserError("check: cannot create a temporary directory");
      SuperviseOptions so;
      so.binary = self_executable();
      so.scenario = spath;
      so.sets = {std::string("ckpt.url=") + tmpl};
      so.threads = a.threads;
      so.progress = false;
      so.child_stderr = std::string(tmpl) + "/children.log";
      so.announce_restarts = false;  // a fault scenario restarts by design; its line says how it ended
      // --launcher mpi: each attempt one process per rank, under mpirun.
      const bool processes = a.launcher == "mpi" && s.mesh.world() > 1;
      if (processes) so.launcher = "mpi";
      if (backend == Backend::kCudaEmulated || backend == Backend::kCuda)
        so.extra_args = {"--backend", a.backend};
      const SuperviseResult r = supervise(so);
      const std::string got = r.summary.value("final_state_hash", "");
      const size_t restarts = r.summary.value("restarts", nlohmann::json::array()).size();
      // The child's: with data.path it covers the file's content.
      const std::string fp = r.summary.value("fingerprint", scenario_fingerprint(s));
      GoldenMismatch m;
      if (r.exit_code != 0) {
        m.field = "run";
        m.golden = "exit 0";
        m.now = "exit " + std::to_string(r.exit_code);
        m.message = r.error.empty() ? "the supervised run failed (exit " + std::to_string(r.exit_code) + ")" : r.error;
      } else if (fp != g.value("fingerprint", "")) {
        m.field = "fingerprint";
        m.golden = g.value("fingerprint", "");
        m.now = fp;
        m.message = "scenario fingerprint differs from the twin's golden file";
      } else if (got != g.value("final_state_hash", "")) {
        m.step = s.steps;
        m.field = "final_state_hash";
        m.golden = g.value("final_state_hash", "");
        m.now = got;
        m.message = "final_state_hash " + got + " differs from the golden";
        // Where it parted: the first loss the restarted job got other bits for.
        const nlohmann::json want = g.value("loss_bits", nlohmann::json::array()),
                             bits = r.summary.value("loss_bits", nlohmann::json::array());
        const int first = r.summary.value("losses_first_step", 1);
        for (size_t i = 0; i < bits.size(); ++i) {
          const size_t at = (size_t)first - 1 + i;
          if (first < 1 || at >= want.size() || bits[i] == want[at]) continue;
          m.step = (int)at + 1;
          m.field = "loss_bits";
          m.golden = want[at].get<std::string>();
          m.now = bits[i].get<std::string>();
          m.message = "step " + std::to_string(m.step) + ": loss_bits differ: golden " + m.golden + ", now " + m.now +
                      " (final_state_hash " + got + " differs from the golden)";
          break;
        }
      }
      const NextStep next = next_step(m, g, spath, gpath, a.golden_dir);
      outcome.add(s, spath, gpath, seconds_since(t0), m,
                  {{"kind", "faults"}, {"launcher", processes ? "mpi" : "threads"},
                   {"processes", processes ? s.mesh.world() : 1}, {"restarts", restarts}, {"final_state_hash", got},
                   {"logs", m.differs() ? nlohmann::json(tmpl) : nlohmann::json(nullptr)},
                   {"ulp_distance", next.json_ulps()}, {"next", next.json_command()}});
      if (!m.differs()) {
        if (!a.json)
          std::printf("ok    %-*s %-*s %zu restart%s%s, final_state_hash %s\n", name_w, w.name.c_str(), file_w,
                      file.c_str(), restarts, restarts == 1 ? "" : "s",
                      processes ? (", " + std::to_string(s.mesh.world()) + " processes").c_str() : "", got.c_str());
        fs::remove_all(tmpl);
      } else {
        ++failed;
        if (!a.json)
          std::printf("FAIL  %-*s %-*s %s (logs in %s)\n%s", name_w, w.name.c_str(), file_w, file.c_str(),
                      m.message.c_str(), tmpl,
                      next.command.empty() ? "" : ("      next: " + next.command + "\n").c_str());
      }
      continue;
    }
    RunOptions opt;
    opt.threads = a.threads;
    opt.backend = backend;
    opt.progress = tty;
    opt.hash_at = golden_hash_steps(s.steps);
    opt.eval = false;
    const bool processes = a.launcher == "mpi" && s.mesh.world() > 1;
    RunResult r;
    GoldenMismatch m;
    try {
      r = processes ? run_under_mpirun(spath, s, a.threads) : run_scenario(s, opt);
      m = golden_mismatch(g, r);
    } catch (const UserError& e) {
      if (!processes) throw;
      m.field = "run";  // one failing variant, reported; the others still run
      m.message = e.what();
    }
    const NextStep next = next_step(m, g, spath, gpath, a.golden_dir);
    outcome.add(s, spath, gpath, seconds_since(t0), m,
                {{"kind", "golden"}, {"launcher", processes ? "mpi" : "threads"},
                 {"processes", processes ? s.mesh.world() : 1}, {"threads", r.threads}, {"steps", r.steps},
                 {"final_state_hash", r.final_state_hash}, {"ulp_distance", next.json_ulps()},
                 {"next", next.json_command()}});
    if (!m.differs()) {
      if (!a.json)
        std::printf("ok    %-*s %-*s %d steps, %s, final_state_hash %s\n", name_w, w.name.c_str(), file_w,
                    file.c_str(), r.steps,
                    processes ? (std::to_string(s.mesh.world()) + " processes").c_str()
                              : (std::to_string(r.threads) + (r.threads == 1 ? " thread" : " threads")).c_str(),
                    r.final_state_hash.c_str());
    } else {
      ++failed;
      if (!a.json)
        std::printf("FAIL  %-*s %-*s %s (golden %s)\n%s", name_w, w.name.c_str(), file_w, file.c_str(),
                    m.message.c_str(), gpath.c_str(),
                    next.command.empty() ? "" : ("      next: " + next.command + "\n").c_str());
    }
  }
  if (a.json)
    std::printf("%s\n", nlohmann::json{{"scenarios", work.size()}, {"failed", failed}, {"results", outcome.results}}
                             .dump()
                             .c_str());
  else
    std::printf("check: %zu scenario%s, %d failed\n", work.size(), work.size() == 1 ? "" : "s", failed);
  if (!a.junit.empty()) write_junit(a.junit, "lockstep check", outcome.cases);
  return failed ? 1 : 0;
}

// The mesh a checkpoint was saved on, as MeshConfig::describe prints it.
std::string saved_mesh_text(const Manifest& m) {
  int mb = 1;
  const MeshConfig mesh = mesh_from_json(m.mesh.is_object() ? m.mesh : nlohmann::json::object(), &mb);
  return mesh.describe(mb);
}

// ckpt verify: every object of the checkpoint read back against its
// manifest. What it finds corrupt, the manifest included, is its finding
// (exit 1, as check's); no checkpoint there at all is bad input (exit 2).
int verify_checkpoint(ObjectStore& store, int64_t at) {
  const std::vector<int64_t> steps = committed_steps(store);
  Manifest m;
  try {
    m = read_manifest(store, at);
  } catch (const UserError& e) {
    const int64_t step = at < 0 && !steps.empty() ? steps.back() : at;
    if (std::find(steps.begin(), steps.end(), step) == steps.end()) throw;  // nothing to verify
    std::printf("BAD   %s  (%s)\n", manifest_key(step).c_str(), e.what());
    std::printf("verify: step %lld, manifest unreadable, 1 bad\n", (long long)step);
    return 1;
  }
  int bad = 0;
  for (const ManifestObject& o : m.objects) {
    std::string why;
    try {
      const std::vector<uint8_t> b = store.get(o.key);
      if (b.size() != o.size) why = "size " + std::to_string(b.size()) + ", manifest says " + std::to_string(o.size);
      else if (xxh128_hex(b.data(), b.size()) != o.xxh128) why = "checksum mismatch";
    } catch (const std::exception& e) {
      why = e.what();
    }
    std::printf("%s  %s%s\n", why.empty() ? "ok  " : "BAD ", o.key.c_str(),
                why.empty() ? "" : ("  (" + why + ")").c_str());
    bad += !why.empty();
  }
  std::printf("verify: step %lld, %zu objects, %d bad\n", (long long)m.step, m.objects.size(), bad);
  return bad ? 1 : 0;
}

int cmd_ckpt(const std::string& verb, const std::string& target, const std::string& endpoint, bool as_json) {
  const auto [url, at] = split_checkpoint_url(target);
  std::unique_ptr<ObjectStore> store = open_store(url, StoreOptions{endpoint});
  if (verb == "ls") {
    const std::vector<int64_t> steps = committed_steps(*store);
    // No folder there is a wrong path (exit 2, as inspect and verify say it);
    // an empty store is a listing of nothing.
    std::error_code ec;
    if (steps.empty() && store->url().rfind("file://", 0) == 0 && !fs::exists(store->url().substr(7), ec))
      throw UserError(no_checkpoint_in(*store));
    if (steps.empty()) std::printf("%s\n", no_checkpoint_in(*store).c_str());
    for (int64_t s : steps) {
      const Manifest m = read_manifest(*store, s);
      uint64_t bytes = 0;
      for (const ManifestObject& o : m.objects) bytes += o.size;
      std::printf("step %-8lld %3zu objects %12llu bytes  mesh %s  state_hash %s\n", (long long)s, m.objects.size(),
                  (unsigned long long)bytes, saved_mesh_text(m).c_str(), m.state_hash.empty() ? "-" : m.state_hash.c_str());
    }
    return 0;
  }
  if (verb == "verify") return verify_checkpoint(*store, at);
  const Manifest m = read_manifest(*store, at);
  if (verb == "inspect") {
    if (as_json) {
      // The manifest as stored, and beside it (not in it: older builds read
      // the manifest's fields strictly) the mesh as the other tools print it.
      nlohmann::json j = manifest_to_json(m);
      j["mesh_text"] = saved_mesh_text(m);
      std::printf("%s\n", j.dump(2).c_str());
      return 0;
    }
    std::printf("checkpoint of step %lld in %s\n  fingerprint %s\n  mesh %s\n  %zu objects, %zu tensors\n",
                (long long)m.step, store->url().c_str(), m.fingerprint.c_str(), saved_mesh_text(m).c_str(),
                m.objects.size(), m.tensors.size());
    for (const ManifestObject& o : m.objects)
      std::printf("  %-40s %12llu bytes  xxh128 %s  rank %d\n", o.key.c_str(), (unsigned long long)o.size,
                  o.xxh128.c_str(), o.writer_rank);
    for (const ManifestTensor& t : m.tensors) {
      std::string shape;
      for (int64_t d : t.global_shape) shape += (shape.empty() ? "" : "x") + std::to_string(d);
      std::printf("  %-40s [%s] in %zu piece%s\n", t.name.c_str(), shape.c_str(), t.pieces.size(),
                  t.pieces.size() == 1 ? "" : "s");
    }
  }
  return 0;
}

// ckpt gc: objects of torn checkpoints (docs in ckpt/gc.h); a dry run unless do_delete.
int cmd_ckpt_gc(const std::string& url, const std::string& endpoint, bool do_delete) {
  std::unique_ptr<ObjectStore> store = open_store(url, StoreOptions{endpoint});
  const GcReport r = collect_garbage(*store, do_delete);
  auto steps = [](const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return s.empty() ? std::string("none") : s;
  };
  for (size_t i = 0; i < r.orphan_keys.size(); ++i)
    std::printf("%s %-44s %12llu bytes\n", r.deleted ? "deleted " : "orphan  ", r.orphan_keys[i].c_str(),
                (unsigned long long)r.orphan_sizes[i]);
  for (const auto& t : r.stale_temps)
    std::printf("%s %-44s %12llu bytes  (temp file of a dead writer)\n", r.deleted ? "deleted " : "stale   ",
                t.path.c_str(), (unsigned long long)t.bytes);
  if (!r.newest_in_progress.empty())
    std::printf("kept: step %s torn but newer than every commit (possibly in progress)\n",
                steps(r.newest_in_progress).c_str());
  if (!r.unreadable_steps.empty())
    std::printf("kept: step %s committed, manifest unreadable (directory left alone)\n", steps(r.unreadable_steps).c_str());
  const std::string kept =
      r.newest_in_progress.empty() ? "" : "; kept, possibly in progress: " + steps(r.newest_in_progress);
  std::printf("gc: %zu orphan object%s, %llu bytes (torn steps collected: %s%s; committed: %s) %s\n",
              r.orphan_keys.size(), r.orphan_keys.size() == 1 ? "" : "s", (unsigned long long)r.orphan_bytes,
              steps(r.torn_steps).c_str(), kept.c_str(), steps(r.committed_steps).c_str(),
              r.deleted ? "deleted" : "would be deleted (dry run; --delete to delete)");
  if (!r.stale_temps.empty())
    std::printf("gc: %zu stale temp file%s, %llu bytes %s\n", r.stale_temps.size(), r.stale_temps.size() == 1 ? "" : "s",
                (unsigned long long)r.stale_temp_bytes, r.deleted ? "deleted" : "would be deleted");
  for (const auto& u : r.stale_uploads)
    std::printf("%s %-44s upload %s, begun %s (incomplete multipart upload)\n", r.deleted ? "aborted " : "stale   ",
                u.key.c_str(), u.upload_id.c_str(), u.initiated.c_str());
  for (const auto& u : r.uploads_in_progress)
    std::printf("kept     %-44s upload %s, begun %s (newer than every commit: possibly in progress)\n", u.key.c_str(),
                u.upload_id.c_str(), u.initiated.c_str());
  if (!r.uploads_listed)
    std::printf("gc: incomplete multipart uploads not checked: this server does not list them (ListMultipartUploads)\n");
  if (!r.stale_uploads.empty() || !r.uploads_in_progress.empty())
    std::printf("gc: %zu incomplete multipart upload%s %s; %zu possibly in progress kept\n", r.stale_uploads.size(),
                r.stale_uploads.size() == 1 ? "" : "s", r.deleted ? "aborted" : "would be aborted",
                r.uploads_in_progress.size());
  if (!r.empty_dirs.empty())
    std::printf("gc: %zu empty step director%s (of checkpoints removed earlier) %s\n", r.empty_dirs.size(),
                r.empty_dirs.size() == 1 ? "y" : "ies", r.deleted ? "deleted" : "would be deleted");
  return 0;
}


// Under mpirun every rank process meets a refusal of the input (exit 2,
// or the lease another job holds) the same way, or learns it from rank 0
// (share_error): rank 0 alone says it, and the others exit with the same
// code without a word, instead of once per rank. Store and internal errors
// may be one rank's own: every rank that meets one says it.
bool quiet_rank_refusal(const Failure& f) {
  if (f.exit_code != 2 && f.exit_code != kExitLeaseLost) return false;
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  return launched_by_mpirun() && rank && std::string(rank) != "0";
}

}  // namespace

int main(int argc, char** argv) {
  g_args.assign(argv, argv + argc);
  CLI::App app{"lockstep: deterministic MoE training simulator and reproducibility harness.\n"
               "Bits depend on the math, never on threads, SIMD or decomposition."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "lockstep 0.1.0");

  RunArgs ra;
  auto* run = app.add_subcommand("run", "train a scenario and print a summary (--json: one JSON object, last line)");
  run->add_option("scenario", ra.scenario, "scenario JSON file")->required();
  run->add_option("--set", ra.sets, "override a scenario key: dotted.key=value (repeatable)");
  run->add_option("--threads", ra.threads, "worker threads (default: all cores); the engine runs them as data lanes of whole samples where the bits allow, else splits each op (README, Speed)")->check(CLI::Range(1, 1024));
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
                  "threads (default: every rank a thread of this process) or mpi (starts mpirun -np mesh.dp x mesh.tp x mesh.pp "
                  "x mesh.cp, one process per rank; docs/CLUSTER.md)");
  run->add_option("--steps", ra.steps,
                  "stop after this many steps (at most train.steps); the learning-rate schedule stays train.steps' (so a run stopped "
                  "early matches the full run's first N steps bit for bit, and its checkpoints resume it)");
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
  run->add_flag("--supervise", ra.supervise, "run as a supervised child process, restarted from checkpoints on failure");
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

  RunArgs pa;
  auto* plan = app.add_subcommand("plan", "estimate a scenario's memory per part (weights, moments, activations, MoE "
                                          "buffers, checkpoint staging) against what is available; trains nothing "
                                          "(exit 0 fits, 5 does not fit, 2 bad input)");
  plan->add_option("scenario", pa.scenario, "scenario JSON file")->required();
  plan->add_option("--set", pa.sets, "override a scenario key: dotted.key=value (repeatable)");
  plan->add_option("--threads", pa.threads, "worker threads the run would use")->check(CLI::Range(1, 1024));
  plan->add_option("--backend", pa.backend, "engine, reference, cuda-emulated or cuda");
  plan->add_option("--resume", pa.resume,
                   "count the restore buffers of a resumed run (URL or URL@STEP; none committed there: exit 2)");
  plan->add_option("--launcher", pa.launcher,
                   "threads (default: one process holds every rank) or mpi (one process per rank: the estimate is "
                   "per process, the largest rank's, and the host needs the processes' sum)");
  plan->add_flag("--json", pa.json, "one JSON object");

  GoldenArgs ga;
  auto* golden = app.add_subcommand("golden", "write golden/<name>.json: per-step loss bits and state hashes");
  golden->add_option("scenarios", ga.scenarios, "scenario JSON files")->required();
  golden->add_option("--golden-dir", ga.golden_dir, "where golden files live (default: golden)");
  golden->add_flag("--no-reference", ga.no_reference, "skip the cross-check against the scalar reference");
  golden->add_option("--threads", ga.threads, "worker threads")->check(CLI::Range(1, 1024));

  CheckArgs ca;
  auto* check = app.add_subcommand("check", "rerun scenarios and compare with their golden files (default: all)");
  check->add_option("scenarios", ca.scenarios, "scenario JSON files (default: every golden file's scenario)");
  check->add_option("--golden-dir", ca.golden_dir, "where golden files live (default: golden)");
  check->add_option("--scenario-dir", ca.scenario_dir,
                    "the folder of the golden files' scenarios, with its variants/ and faults/ (default: the path "
                    "each golden file records, read from the golden folder's parent: <golden-dir>/../scenarios/...)");
  check->add_option("--threads", ca.threads, "worker threads")->check(CLI::Range(1, 1024));
  check->add_option("--backend", ca.backend, "engine, reference, cuda-emulated or cuda");
  check->add_option("--launcher", ca.launcher,
                    "threads (default) or mpi: run each multi-rank variant as mpirun -np mesh.dp x mesh.tp x mesh.pp x "
                    "mesh.cp, one process per rank");
  check->add_flag("--json", ca.json,
                  "print one JSON object instead of the lines: per scenario ok, and for a failure the first differing "
                  "step and field with both values");
  check->add_option("--junit", ca.junit,
                    "also write JUnit XML here for CI: one test case per scenario or variant, a failure naming the "
                    "first differing step and field");

  std::string diff_a, diff_b;
  bool diff_json_out = false, diff_with_dumps = false;
  auto* diff = app.add_subcommand("diff", "compare two traces: first divergent step/op/tensor/element and its spread "
                                          "(exit 0 identical, 1 different, 4 one trace ends early and "
                                          "the steps both hold are identical)");
  diff->add_option("a", diff_a, "first trace (from run --trace)")->required();
  diff->add_option("b", diff_b, "second trace")->required();
  diff->add_flag("--json", diff_json_out, "print the comparison as one JSON object (dumped tensors' base64 "
                                          "data left out: the differing elements are in 'elements')");
  diff->add_flag("--with-dumps", diff_with_dumps, "with --json: keep the dumped tensors' base64 data (megabytes)");

  std::string report_a, report_b, report_out, report_title;
  auto* report = app.add_subcommand("report", "compare two traces as one self-contained HTML page (loss curves, "
                                              "first divergence, step x layer ULP heat map, spread)");
  report->add_option("a", report_a, "first trace (from run --trace)")->required();
  report->add_option("b", report_b, "second trace")->required();
  report->add_option("-o,--out", report_out, "HTML file to write")->required();
  report->add_option("--title", report_title, "page title (default: 'A vs B' from the file names)");

  BisectArgs ba;
  auto* bisect = app.add_subcommand(
      "bisect", "two runs that disagree -> first divergent step/op/tensor/element and the smallest set of "
                "differences (config keys, backend, binary, threads) that causes it (exit 0 agree, 1 differ); "
                "mesh keys are set aside and both sides compared on one rank (docs/TRACE.md)");
  bisect->add_option("scenario_a", ba.scenario_a, "scenario of run A")->required();
  bisect->add_option("scenario_b", ba.scenario_b, "scenario of run B (default: the same)");
  bisect->add_option("--set-a", ba.sets_a, "override for run A: dotted.key=value (repeatable)");
  bisect->add_option("--set-b", ba.sets_b, "override for run B (repeatable)");
  // Each side is a child `lockstep run --backend X`: every backend run takes.
  bisect->add_option("--backend-a", ba.backend_a,
                     "backend of run A: engine (default), reference, cuda-emulated or cuda, as run --backend");
  bisect->add_option("--backend-b", ba.backend_b, "backend of run B: engine (default), reference, cuda-emulated or cuda");
  bisect->add_option("--bin-a", ba.bin_a, "lockstep binary for run A (default: this one)");
  bisect->add_option("--bin-b", ba.bin_b, "lockstep binary for run B");
  bisect->add_option("--threads-a", ba.threads_a, "threads for run A")->check(CLI::Range(1, 1024));
  bisect->add_option("--threads-b", ba.threads_b, "threads for run B")->check(CLI::Range(1, 1024));
  bisect->add_option("--steps", ba.steps, "compare at most this many steps")->check(CLI::Range(1, 1000000));
  bisect->add_option("--keep", ba.keep, "keep the traces in this directory");
  bisect->add_flag("--json", ba.json,
                   "print one JSON object on stdout (agree, verdict, first divergence, the minimal differences, mesh "
                   "bugs); the report's lines go to stderr");
  bisect->add_option("--launcher", ba.launcher,
                     "threads (default) or mpi: a side's runs on more than one rank go under mpirun, one process per "
                     "rank, as run --launcher mpi (its one-rank twins stay in one process)");
  bisect->add_option("--debug-mesh-fault-b", ba.debug_mesh_fault_b,
                     "debug only: run B plants a mesh fault (run --debug-mesh-fault) for bisect to locate")
      ->group("Debug");

  std::string ckpt_url, ckpt_endpoint;
  bool ckpt_json = false;
  auto* ckpt = app.add_subcommand("ckpt", "list, inspect, verify and garbage-collect checkpoints in an object store");
  ckpt->require_subcommand(1);
  auto* ckpt_ls = ckpt->add_subcommand("ls", "list committed checkpoints (those with a manifest)");
  auto* ckpt_inspect = ckpt->add_subcommand("inspect", "print a checkpoint's manifest (URL or URL@STEP)");
  auto* ckpt_verify = ckpt->add_subcommand("verify", "read every object of a checkpoint and check its checksum");
  auto* ckpt_gc = ckpt->add_subcommand("gc", "find (--delete: delete) objects of torn checkpoints; dry run by default");
  bool ckpt_delete = false;
  ckpt_gc->add_flag("--delete", ckpt_delete, "delete the orphans (default: only list them)");
  for (CLI::App* sub : {ckpt_ls, ckpt_inspect, ckpt_verify, ckpt_gc}) {
    sub->add_option("url", ckpt_url, "file://DIR, a path, or s3://bucket/prefix")->required();
    sub->add_option("--s3-endpoint", ckpt_endpoint, "S3 endpoint (default: env LOCKSTEP_S3_ENDPOINT)");
  }
  ckpt_inspect->add_flag("--json", ckpt_json, "the manifest as JSON");

  SweepArgs sa;
  auto* faults_cmd = app.add_subcommand("faults", "fault injection tools");
  faults_cmd->require_subcommand(1);
  auto* sweep = faults_cmd->add_subcommand(
      "sweep", "kill supervised runs at random points (weighted toward checkpoint I/O); every one must end on the "
               "fault-free final_state_hash (exit 1 otherwise)");
  sweep->add_option("scenario", sa.scenario, "scenario JSON file")->required();
  sweep->add_option("--set", sa.sets, "override a scenario key (repeatable)");
  sweep->add_option("--trials", sa.trials, "runs (default 20)");
  sweep->add_option("--seed", sa.seed, "seed of the fault placement");
  sweep->add_flag("--store-faults", sa.store_faults, "also inject transient store errors in some trials");
  sweep->add_flag("--keep", sa.keep, "keep the trial checkpoints (no gc)");
  sweep->add_option("--threads", sa.threads, "threads per run")->check(CLI::Range(1, 1024));
  sweep->add_flag("--json", sa.json,
                  "print one JSON object instead of the counts: the counts and, per trial, its faults, outcome and "
                  "for a failure the first differing step and field");
  sweep->add_option("--junit", sa.junit,
                    "also write JUnit XML here for CI: one test case per trial, a failure naming the first differing "
                    "step and field");
  sweep->add_option("--launcher", sa.launcher,
                    "threads (default: ranks are threads of each run's process) or mpi (each trial an mpirun job, one "
                    "process per rank; kills hit random rank processes)");

  bool keys_md = false;
  auto* keys = app.add_subcommand("keys", "list every scenario key with its type, default and meaning");
  keys->add_flag("--markdown", keys_md, "as the Markdown table of docs/SCENARIOS.md");
  bool keys_json = false;
  keys->add_flag("--json", keys_json,
                 "one JSON object: {\"keys\": [{key, type, default, doc, constraint}, ...]} in table order");

  // An unknown command gets the closest one, as unknown scenario keys do.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string cmd = argv[1];
    std::string best;
    size_t best_d = SIZE_MAX;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands({})) {
      known = known || sub->get_name() == cmd;
      const size_t d = edit_distance(cmd, sub->get_name());
      if (d < best_d) best_d = d, best = sub->get_name();
    }
    if (!known) {
      std::string all;
      for (const CLI::App* sub : app.get_subcommands({})) all += (all.empty() ? "" : ", ") + sub->get_name();
      std::fprintf(stderr, "lockstep: error: unknown command '%s'%s (commands: %s; lockstep --help)\n",
                   quote_for_message(cmd).c_str(), best_d <= 2 ? (" (did you mean '" + best + "'?)").c_str() : "",
                   all.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    // As every other refusal says it: one line, the prefix, exit 2.
    std::string where = "lockstep";
    for (const CLI::App* sub = &app; sub && !sub->get_subcommands().empty();) {
      sub = sub->get_subcommands().front();
      where += " " + sub->get_name();
    }
    std::fprintf(stderr, "lockstep: error: %s (%s --help)\n", e.what(), where.c_str());
    return 2;
  }
  try {
    if (*run) return cmd_run(ra, self_executable().c_str());
    if (*plan) {
      pa.dry_run = true;
      return cmd_run(pa, self_executable().c_str());
    }
    if (*golden) return cmd_golden(ga);
    if (*check) return cmd_check(ca);
    if (*bisect) return cmd_bisect(ba);
    if (*faults_cmd) return cmd_faults_sweep(sa);
    if (*ckpt && *ckpt_gc) return cmd_ckpt_gc(ckpt_url, ckpt_endpoint, ckpt_delete);
    if (*ckpt) return cmd_ckpt(*ckpt_ls ? "ls" : *ckpt_inspect ? "inspect" : "verify", ckpt_url, ckpt_endpoint, ckpt_json);
    if (*report) {
      const Trace ta = read_trace(report_a), tb = read_trace(report_b);
      const TraceDiff d = diff_traces(ta, tb);
      if (report_title.empty())
        report_title = fs::path(report_a).filename().string() + " vs " + fs::path(report_b).filename().string();
      write_file_atomic(report_out, render_report(ta, tb, d, report_title));
      std::printf("wrote %s (%s)\n", report_out.c_str(), verdict_text(d).c_str());
      return 0;
    }
    if (*diff) {
      if (diff_with_dumps && !diff_json_out) throw UserError("--with-dumps: only with --json (the text shows no dump)");
      TraceDiff d = diff_traces(read_trace(diff_a), read_trace(diff_b));
      if (diff_json_out) std::printf("%s\n", diff_json(d, diff_with_dumps).dump().c_str());
      else std::printf("%s", format_diff(d).c_str());
      return d.identical ? 0 : d.identical_until_truncation() ? 4 : 1;
    }
    if (*keys) {
      if (keys_md && keys_json) throw UserError("keys: --markdown or --json, not both");
      if (keys_md) {
        std::printf("%s", scenario_keys_markdown().c_str());
      } else if (keys_json) {
        nlohmann::json all = nlohmann::json::array();
        for (const ScenarioKey& k : scenario_keys())
          all.push_back({{"key", k.key}, {"type", k.type}, {"default", k.default_value}, {"doc", k.doc},
                         {"constraint", k.constraint}});
        std::printf("%s\n", nlohmann::json{{"keys", all}}.dump().c_str());
      } else {
        for (const ScenarioKey& k : scenario_keys())
          std::printf("%-24s %-8s %-12s %s\n", k.key.c_str(), k.type.c_str(), k.default_value.dump().c_str(),
                      k.doc.c_str());
      }
      return 0;
    }
  } catch (const std::exception&) {
    const Failure f = describe_failure(std::current_exception());
    if (!quiet_rank_refusal(f)) std::fprintf(stderr, "%s\n", f.message.c_str());
    if (f.signal) die_of_signal(f.signal);  // as an interrupted command ends: 128 + signal in a shell
    return f.exit_code;
  }
  return 0;
}
