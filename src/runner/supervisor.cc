#include "runner/supervisor.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "ckpt/checkpointer.h"
#include "ckpt/lease.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "contract.h"
#include "faults/injector.h"
#include "runner/lifeline.h"
#include "runner/scenario.h"
#include "store/store.h"

extern char** environ;

namespace fs = std::filesystem;

namespace ls {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Lines of the state file after the first `seen`; advances `seen`.
std::vector<std::string> new_lines(const std::string& path, size_t& seen) {
  std::vector<std::string> out;
  std::ifstream in(path);
  std::string line;
  size_t n = 0;
  while (std::getline(in, line))
    if (n++ >= seen) out.push_back(line);
  seen = n;
  return out;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  const int code = WEXITSTATUS(status);
  if (code == kExitRankCrash) return "exit " + std::to_string(code) + " (a rank crashed)";
  if (code == kExitMeshChange) return "exit " + std::to_string(code) + " (the mesh changed: shrink/grow)";
  if (code == kExitLeaseLost) return "exit " + std::to_string(code) + " (another job took the checkpoint lease)";
  return "exit " + std::to_string(code);
}

// The job's per-step record from every attempt's step log: the last write of
// a step wins (a replayed step has the same bits). Fills losses, loss_bits,
// evals, eval_bpb and the speed over every step any attempt ran; throws if a
// step in [first, last] has no record.
void stitch_steps(const std::string& log, int first, int last, int64_t tokens_per_step, nlohmann::json& summary) {
  std::map<int, std::string> loss_bits;
  std::map<int, std::string> evals;
  double seconds = 0;
  int64_t steps_run = 0;
  std::istringstream text(slurp(log));
  std::string kind, bits;
  int step = 0;
  for (std::string line; std::getline(text, line);) {
    std::istringstream l(line);
    if (!(l >> kind >> step >> bits)) continue;
    if (kind == "step") {
      double s = 0;
      l >> s;
      loss_bits[step] = bits;
      seconds += s;
      ++steps_run;
    } else if (kind == "eval") {
      evals[step] = bits;
    }
  }
  nlohmann::json losses = nlohmann::json::array(), lbits = nlohmann::json::array();
  for (int s = first; s <= last; ++s) {
    auto it = loss_bits.find(s);
    if (it == loss_bits.end())
      throw std::runtime_error("supervisor: no attempt recorded the loss of step " + std::to_string(s));
    lbits.push_back(it->second);
    losses.push_back(from_bits((uint32_t)std::stoul(it->second, nullptr, 16)));
  }
  nlohmann::json ev = nlohmann::json::array();
  for (auto& [s, b] : evals) ev.push_back({{"step", s}, {"bpb", from_bits((uint32_t)std::stoul(b, nullptr, 16))}});
  summary["losses_first_step"] = first;
  summary["losses"] = losses;
  summary["loss_bits"] = lbits;
  summary["evals"] = ev;
  summary["eval_bpb"] = ev.empty() ? nlohmann::json(nullptr) : ev.back()["bpb"];
  // Every step any attempt ran, replays included: the job's real throughput.
  summary["steps_run"] = steps_run;
  summary["tokens_per_second"] = seconds > 0 ? (double)steps_run * tokens_per_step / seconds : 0.0;
  summary["seconds"] = seconds;
}

// The newest committed step at url, or -1 when none is.
int64_t latest_commit(const std::string& url, const std::string& endpoint) {
  std::unique_ptr<ObjectStore> store = open_store(url, StoreOptions{endpoint});
  const std::vector<int64_t> steps = committed_steps(*store);
  return steps.empty() ? -1 : steps.back();
}

// The step a --resume URL[@STEP] starts from: STEP, or the latest commit there.
int64_t resume_step(const std::string& resume, const std::string& endpoint) {
  const auto [url, at] = split_checkpoint_url(resume);
  if (at >= 0) return at;
  const int64_t latest = latest_commit(url, endpoint);
  if (latest < 0) throw UserError("--resume: no committed checkpoint (no manifest) in " + url);
  return latest;
}

// Kills every process of session `sid` and waits (up to 5 s) until none is
// left; returns how many were still there when the job's leader had ended.
int kill_session(int sid) {
  std::vector<int> left = session_processes(sid);
  const int found = (int)left.size();
  for (int i = 0; i < 500 && !left.empty(); ++i) {
    for (int pid : left) ::kill(pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    left = session_processes(sid);
  }
  return found;
}

// SIGINT, SIGTERM and SIGHUP while a supervisor runs: recorded here, acted
// on by its loop (a handler may do nothing else safely).
volatile sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// Installs on_stop_signal for the supervisor's lifetime; a signal the
// caller ignores (nohup, a background job of a shell) stays ignored.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    for (size_t i = 0; i < 3; ++i) {
      struct sigaction sa {};
      sa.sa_handler = on_stop_signal;
      sigemptyset(&sa.sa_mask);
      ::sigaction(kSignals[i], nullptr, &old_[i]);
      if (old_[i].sa_handler != SIG_IGN) ::sigaction(kSignals[i], &sa, nullptr);
    }
  }
  ~StopSignals() {
    for (size_t i = 0; i < 3; ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
  }

 private:
  static constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction old_[3];
};

// Sleeps `seconds`, returning early once a stop signal arrived.
void sleep_unless_stopped(double seconds) {
  const double until = now() + seconds;
  while (!g_stop_signal && now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

}  // namespace

namespace {

// Calls f(pid, session, /proc/PID directory) for every live (non-zombie)
// process but this one. Linux /proc.
template <class F>
void for_each_live_process(F&& f) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const int pid = std::atoi(name.c_str());
    if (pid == ::getpid()) continue;
    // /proc/PID/stat: pid (comm) state ppid pgrp session ...; comm may hold spaces.
    const std::string stat = slurp(e.path() / "stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    std::string state;
    int ppid = 0, pgrp = 0, session = 0;
    if (!(rest >> state >> ppid >> pgrp >> session)) continue;
    if (state != "Z") f(pid, session, e.path());  // a zombie is dead already
  }
}

}  // namespace

std::vector<int> session_processes(int sid) {
  std::vector<int> out;
  for_each_live_process([&](int pid, int session, const fs::path&) {
    if (session == sid) out.push_back(pid);
  });
  return out;
}

std::vector<int> live_processes_matching(const std::string& text) {
  std::vector<int> out;
  for_each_live_process([&](int pid, int, const fs::path& dir) {
    std::ifstream in(dir / "cmdline", std::ios::binary);
    const std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.find(text) != std::string::npos) out.push_back(pid);
  });
  return out;
}

namespace {

// Passes `sig` on to the whole job (the child; under mpi, every process of
// its session: mpirun and the ranks), reaps the child, and gives the job
// 5 s to end before SIGKILL. Returns the processes signalled.
int stop_job(pid_t pid, bool mpi, int sig) {
  std::vector<int> procs = mpi ? session_processes(pid) : std::vector<int>{pid};
  for (int p : procs) ::kill(p, sig);
  int status = 0;
  bool reaped = false;
  for (int i = 0; i < 500; ++i) {
    reaped = reaped || ::waitpid(pid, &status, WNOHANG) == pid;
    if (reaped && (!mpi || session_processes(pid).empty())) return (int)procs.size();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (mpi) kill_session(pid);
  ::kill(pid, SIGKILL);
  if (!reaped) ::waitpid(pid, &status, 0);
  return (int)procs.size();
}

const char* signal_name(int sig) {
  return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP" : "a signal";
}

}  // namespace

SuperviseResult supervise(const SuperviseOptions& opt) {
  const Scenario s = load_scenario(opt.scenario, opt.sets);
  // Every fault the children inject, in their order (bad specs: exit 2 before anything runs).
  std::vector<FaultSpec> planned = s.faults;
  for (const std::string& f : opt.faults) planned.push_back(parse_fault(f));
  const bool mpi = opt.launcher == "mpi";
  if (opt.launcher != "threads" && !mpi) throw UserError("--launcher: 'threads' or 'mpi', got '" + opt.launcher + "'");
  if (mpi && !mpi_available())
    throw UserError("--launcher mpi: this lockstep was built without MPI (install libopenmpi-dev via "
                    "scripts/install-deps.sh, then meson setup --reconfigure build)");
  if (s.ckpt.url.empty() || s.ckpt.every <= 0)
    throw UserError("ckpt.url / ckpt.every: a supervised run restarts from committed checkpoints; set both "
                    "(e.g. --set ckpt.url=/tmp/run --set ckpt.every=5)");
  // One live job per prefix: the supervisor takes the lease for the whole
  // job (its children write under it, and restarts keep it), renews it,
  // and releases it when the job ends; an explicit --resume waits out a dead
  // holder's.
  std::unique_ptr<CheckpointLease> lease = CheckpointLease::acquire(
      open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint}), new_job_id(), s.ckpt.lease_seconds,
      !opt.resume.empty(), [](const std::string& m) { std::fprintf(stderr, "supervisor: %s\n", m.c_str()); });
  const char* tmp_root = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp_root && *tmp_root ? tmp_root : "/tmp") + "/lockstep-supervisor-XXXXXX";
  if (!mkdtemp(tmpl.data())) throw UserError("supervisor: cannot create a temporary directory under " + tmpl);
  const fs::path dir = tmpl;
  struct RemoveOnReturn {  // however supervise() returns or throws
    fs::path dir;
    ~RemoveOnReturn() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } remove_dir{dir};
  const StopSignals stop_signals;
  const std::string state = (dir / "faults.state").string(), hb = (dir / "heartbeat").string(),
                    out = (dir / "child.out").string(), step_log = (dir / "steps.log").string();
  const double job_started = now();
  // Where the job starts: the user's --resume, else what ckpt.url already
  // holds (said on the first line: an old run's checkpoints are resumed).
  const int64_t user_resume = opt.resume.empty() ? -1 : resume_step(opt.resume, s.ckpt.s3_endpoint);
  const int64_t existing = latest_commit(s.ckpt.url, s.ckpt.s3_endpoint);
  if (opt.resume.empty() && existing >= 0)  // always: the run will not start from scratch
    std::fprintf(stderr,
                 "supervisor: ckpt.url %s already holds committed checkpoints (latest step %lld): the job resumes "
                 "from it (use a fresh ckpt.url to start from scratch)\n",
                 s.ckpt.url.c_str(), (long long)existing);
  std::mt19937_64 rng(std::hash<std::string>{}(opt.scenario));
  SuperviseResult res;
  nlohmann::json timeline = nlohmann::json::array();
  nlohmann::json pending;  // the restart whose child has not shown a heartbeat yet
  size_t seen = 0;
  int new_dp = 0, attempt = 0;
  double fail_time = 0;
  // After a stop signal, once no process of the job is left: clean up, say
  // so, and die of the signal, as a shell expects of an interrupted command.
  auto die_of_signal = [&](int sig, const std::string& what) {
    fs::remove_all(dir);
    lease->release();
    std::fprintf(stderr, "supervisor: %s: %s; committed checkpoints in %s are intact (continue with --resume %s)\n",
                 signal_name(sig), what.c_str(), s.ckpt.url.c_str(), s.ckpt.url.c_str());
    std::fflush(nullptr);
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    std::_Exit(128 + sig);
  };
  auto say = [&](const std::string& m) {
    if (opt.progress) std::fprintf(stderr, "supervisor: %s\n", m.c_str());
  };
  for (;; ++attempt) {
    std::unique_ptr<ObjectStore> store = open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint});
    const std::vector<int64_t> committed = committed_steps(*store);
    std::vector<std::string> args = {opt.binary, "run", opt.scenario, "--json", opt.child_progress ? "--progress" : "--quiet",
                                     "--fault-state", state, "--heartbeat", hb, "--step-log", step_log,
                                     "--supervisor-pid", std::to_string(::getpid()),
                                     "--lease", lease->job() + ":" + std::to_string(lease->generation())};
    for (const std::string& x : opt.sets) args.insert(args.end(), {"--set", x});
    for (const std::string& f : opt.faults) args.insert(args.end(), {"--fault", f});
    if (new_dp > 0) {
      args.insert(args.end(), {"--set", "mesh.dp=" + std::to_string(new_dp)});
      if (s.mesh.ep > new_dp) args.insert(args.end(), {"--set", "mesh.ep=" + std::to_string(new_dp)});
      if (s.mesh.fsdp && s.mesh.replicate > 1 && new_dp % s.mesh.replicate != 0)
        args.insert(args.end(), {"--set", "mesh.replicate=1"});
    }
    // This job's own commits in ckpt.url win once they pass the user's start.
    // With every one of them unusable, the job (not a user's --resume) starts over.
    if (!committed.empty() && committed.back() > user_resume) {
      args.insert(args.end(), {"--resume", s.ckpt.url});
      if (opt.resume.empty()) args.push_back("--resume-fallback-start");
    } else if (!opt.resume.empty()) args.insert(args.end(), {"--resume", opt.resume});
    if (opt.threads > 0) args.insert(args.end(), {"--threads", std::to_string(opt.threads)});
    args.insert(args.end(), opt.extra_args.begin(), opt.extra_args.end());
    ::unlink(hb.c_str());
    const int np = new_dp > 0 ? new_dp : s.mesh.dp;
    if (mpi) {  // one rank per process: mpirun starts them
      std::vector<std::string> launch = mpirun_command(np);
      args.insert(args.begin(), launch.begin(), launch.end());
    }

    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (!opt.child_stderr.empty())
      posix_spawn_file_actions_addopen(&fa, 2, opt.child_stderr.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    // The job in a session of its own: mpirun puts each rank in its own
    // process group, but they all stay in the session, so the session is
    // what the teardown below kills.
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    if (mpi) posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID);
    pid_t pid;
    const int rc = posix_spawnp(&pid, argv[0], &fa, &attr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) throw UserError(std::string("supervisor: cannot start ") + argv[0] + ": " + std::strerror(rc));
    const double started = now();
    double last_beat = started;
    bool hung = false;
    int status = 0;
    int beat_step = -1;
    for (;;) {
      if (g_stop_signal) {
        // Ctrl-C, kill, a closed terminal: the job goes down with its
        // supervisor, before it exits, and commits nothing more.
        const int sig = g_stop_signal;
        const int n = stop_job(pid, mpi, sig);
        die_of_signal(sig, "stopped the job (" + std::to_string(n) + " process" + (n == 1 ? "" : "es") +
                               ") at step " + std::to_string(beat_step));
      }
      const pid_t w = ::waitpid(pid, &status, WNOHANG);
      if (w == pid) break;
      struct stat st;
      int step_now = -1;
      std::ifstream(hb) >> step_now;
      if (step_now != beat_step) {  // a new step started: progress
        beat_step = step_now;
        last_beat = now();
      }
      if (!pending.is_null() && ::stat(hb.c_str(), &st) == 0) {
        pending["time_to_resume_seconds"] = now() - fail_time;
        pending["resumed"] = true;
        timeline.push_back(pending);
        pending = nullptr;
      }
      if (now() - last_beat > opt.heartbeat_timeout) {
        hung = true;
        if (mpi) kill_session(pid);
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const double detected = now();
    // Whatever way the job ended, no rank process of it may live on into the
    // next attempt (or past the supervisor).
    const int orphans_killed = mpi ? kill_session(pid) : 0;
    if (!pending.is_null()) {  // the child died before its first step: it resumed and replayed nothing
      pending["time_to_resume_seconds"] = nullptr;
      pending["resumed"] = false;
      pending["steps_replayed"] = 0;
      pending["time_to_failure_seconds"] = detected - fail_time;  // what was measured: until it was found dead
      timeline.push_back(pending);
      pending = nullptr;
    }
    const std::vector<std::string> events = new_lines(state, seen);
    if (!hung && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      std::istringstream text(slurp(out));
      std::string line, last;
      while (std::getline(text, line))
        if (!line.empty()) last = line;
      try {
        res.summary = nlohmann::json::parse(last);
      } catch (const std::exception&) {
        res.exit_code = 3;
        res.error = "the last child exited 0 without a JSON summary";
        return res;
      }
      const FiredFaults fired = read_fault_state(state);
      res.summary["restarts"] = timeline;
      res.summary["faults_fired"] = fired.lines;
      res.summary["attempts"] = attempt + 1;
      res.summary["wall_seconds"] = now() - job_started;
      if (opt.resume.empty() && existing >= 0) res.summary["resumed_existing_checkpoint"] = {{"url", s.ckpt.url}, {"step", existing}};
      const int first = (int)(opt.resume.empty() ? std::max<int64_t>(existing, 0) : user_resume) + 1;
      const int last_step = res.summary.value("steps", 0);
      try {
        stitch_steps(step_log, first, last_step, (int64_t)s.batch * s.model.seq_len, res.summary);
      } catch (const std::exception& e) {
        res.exit_code = 3;
        res.error = e.what();
        return res;
      }
      if (res.summary.contains("resumed_from") && first > 1) res.summary["resumed_from"] = first - 1;
      else res.summary.erase("resumed_from");
      // A planned fault that never fired leaves the run unproven: say which.
      std::string missed;
      for (size_t i = 0; i < planned.size(); ++i)
        if (!fired.indices.count((int)i)) missed += (missed.empty() ? "" : ", ") + planned[i].text();
      if (!missed.empty()) {
        res.exit_code = 1;
        res.error = "the run finished but planned fault(s) never fired: " + missed +
                    " (a threshold the checkpoint never reached, or a step the job resumed past)";
        res.summary["faults_not_fired"] = missed;
        return res;
      }
      nlohmann::json fallbacks = nlohmann::json::array();
      size_t from_start = 0;
      for (const std::string& l : new_lines(state, from_start))
        if (l.rfind("fallback", 0) == 0) fallbacks.push_back(l);
      res.summary["restore_fallbacks"] = fallbacks;
      // A job that leaves a rotten checkpoint committed says so (a restore from it would fall back).
      res.summary["corrupt_checkpoints"] =
          corrupt_checkpoints_left(state, *open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint}));
      return res;
    }
    const std::string failure = hung ? "hang (no heartbeat for " + std::to_string((int)opt.heartbeat_timeout) + " s)"
                                     : describe(status);
    int failed_step = 0;
    std::ifstream(hb) >> failed_step;
    const int code = !hung && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == 2 || code == 3 || code == kExitLeaseLost) {
      // Bad input, an unavailable store, or another job on the prefix: restarting cannot help.
      res.exit_code = code;
      res.error = "the job stopped (" + failure + ") at step " + std::to_string(failed_step) + "; not restarting: " +
                  (code == 2 ? "bad input" : code == 3 ? "the store failed" : "another job took the checkpoint lease") +
                  "; committed checkpoints are intact";
      res.summary = {{"restarts", timeline}, {"faults_fired", read_fault_state(state).lines}};
      if (opt.resume.empty() && existing >= 0) res.summary["resumed_existing_checkpoint"] = {{"url", s.ckpt.url}, {"step", existing}};
      say(res.error);
      return res;
    }
    if (attempt >= opt.max_restarts) {
      res.exit_code = 1;
      res.error = "restart budget exhausted after " + std::to_string(attempt) + " restarts (last: " + failure + ")";
      res.summary = {{"restarts", timeline}};
      say(res.error);
      return res;
    }
    const FiredFaults fired = read_fault_state(state);
    if (fired.new_dp > 0) new_dp = fired.new_dp;
    std::unique_ptr<ObjectStore> after = open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint});
    const std::vector<int64_t> now_committed = committed_steps(*after);
    const int64_t restore_step = now_committed.empty() ? 0 : now_committed.back();
    pending = {{"attempt", attempt + 1},
               {"failure", failure},
               {"events", events},
               {"failed_at_step", failed_step},
               {"detection_seconds", detected - std::max(last_beat, started)},
               {"restore_step", restore_step},
               {"steps_replayed", std::max<int64_t>(0, failed_step - 1 - restore_step)},
               {"mesh_dp_after", new_dp > 0 ? new_dp : s.mesh.dp}};
    if (mpi) {
      pending["processes"] = np;
      pending["orphans_killed"] = orphans_killed;
    }
    say(failure + " at step " + std::to_string(failed_step) + "; restarting from " +
        (restore_step ? "checkpoint " + std::to_string(restore_step) : std::string("scratch")) +
        (new_dp > 0 ? " on mesh.dp=" + std::to_string(new_dp) : std::string()));
    fail_time = detected;
    const double backoff = opt.backoff_seconds * std::pow(2.0, std::min(attempt, 6)) *
                           (0.5 + 0.5 * std::uniform_real_distribution<double>(0, 1)(rng));
    sleep_unless_stopped(backoff);
    if (g_stop_signal) die_of_signal(g_stop_signal, "stopped between attempts");
  }
}

}  // namespace ls
