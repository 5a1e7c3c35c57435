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
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "ckpt/checkpointer.h"
#include "ckpt/lease.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "common/stop_signals.h"
#include "contract.h"
#include "faults/injector.h"
#include "runner/lifeline.h"
#include "runner/mpirun_stderr.h"
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

// The highest step of the step log's "step N ..." records after byte
// `from` (one attempt's); 0 when it has none.
int last_step_logged_since(const std::string& log, size_t from) {
  std::ifstream in(log);
  in.seekg((std::streamoff)from);
  int last = 0;
  std::string kind;
  int step = 0;
  for (std::string line; std::getline(in, line);) {
    std::istringstream l(line);
    if (l >> kind >> step && kind == "step") last = std::max(last, step);
  }
  return last;
}

// mpi: the child is mpirun, which exits 128 + N when it saw a rank die of signal N.
std::string describe(int status, bool mpi) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  const int code = WEXITSTATUS(status);
  if (mpi && code > 128 && code < 128 + 65)
    return "exit " + std::to_string(code) + " (a rank process was killed by signal " + std::to_string(code - 128) + ")";
  if (code == kExitRankCrash) return "exit " + std::to_string(code) + " (a rank crashed)";
  if (code == kExitMeshChange) return "exit " + std::to_string(code) + " (the mesh changed: shrink/grow)";
  if (code == kExitLeaseLost) return "exit " + std::to_string(code) + " (another job took the checkpoint lease)";
  if (code == kExitInternalError) return "exit " + std::to_string(code) + " (an internal error: a bug in Lockstep)";
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
  std::unique_ptr<ObjectStore> store = open_store(url, StoreOptions{endpoint});
  const std::vector<int64_t> steps = committed_steps(*store);
  if (steps.empty()) throw UserError("--resume: " + no_checkpoint_in(*store));
  return steps.back();
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

// Sleeps `seconds`, returning early once a stop signal arrived.
void sleep_unless_stopped(double seconds) {
  const double until = now() + seconds;
  while (!stop_signal() && now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

}  // namespace

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

}  // namespace

namespace {

// How one attempt's child ended.
struct AttemptEnd {
  int status = 0;          // waitpid's
  bool hung = false;       // killed for a missing heartbeat
  double started = 0, last_beat = 0, detected = 0;
  int orphans_killed = 0;  // mpi: rank processes left after it ended
  bool exited_ok() const { return !hung && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
  int exit_code() const { return !hung && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
};

// One supervised job: its scenario, lease, scratch directory and the
// timeline of its restarts, and the named steps supervise() runs.
class Supervision {
 public:
  explicit Supervision(const SuperviseOptions& opt);
  ~Supervision() {
    std::error_code ec;
    fs::remove_all(dir_, ec);  // however supervise() returns or throws
  }
  std::vector<std::string> child_command();
  pid_t spawn(std::vector<std::string> args);
  AttemptEnd watch(pid_t pid);
  // The job finished: its summary, stitched over every attempt.
  SuperviseResult finished(int attempt);
  // The failed attempt ends the job (bad input, the store, the lease, the
  // restart budget): the result; or nothing, and the restart is planned.
  std::optional<SuperviseResult> stop_or_plan_restart(const AttemptEnd& end, int attempt);
  void back_off(int attempt);
  // The resumed child of a pending restart showed its first heartbeat or
  // died before it: the restart goes into the timeline.
  void settle_pending(bool resumed, double at);
  [[noreturn]] void die_of_signal(int sig, const std::string& what);

 private:
  void say(const std::string& m) const {
    if (opt_.progress) std::fprintf(stderr, "supervisor: %s\n", m.c_str());
  }
  // What a user must see even without progress lines: a restart.
  void announce(const std::string& m) const {
    if (opt_.progress || opt_.announce_restarts) std::fprintf(stderr, "supervisor: %s\n", m.c_str());
  }
  void note_resumed_existing(nlohmann::json& summary) const {
    if (opt_.resume.empty() && existing_ >= 0) summary["resumed_existing_checkpoint"] = {{"url", s_.ckpt.url}, {"step", existing_}};
  }
  std::unique_ptr<ObjectStore> store() const { return open_store(s_.ckpt.url, StoreOptions{s_.ckpt.s3_endpoint}); }

  const SuperviseOptions& opt_;
  const Scenario s_;
  std::vector<FaultSpec> planned_;  // every fault the children inject, in their order
  const bool mpi_;
  std::unique_ptr<CheckpointLease> lease_;
  fs::path dir_;
  std::string state_, hb_, out_, step_log_;
  double job_started_ = 0;
  int64_t user_resume_ = -1, existing_ = -1;
  std::mt19937_64 rng_;
  nlohmann::json timeline_ = nlohmann::json::array();
  nlohmann::json pending_;  // the restart whose child has not shown a heartbeat yet
  size_t seen_ = 0;         // fault-state lines already read
  size_t attempt_log_from_ = 0;  // the step log's size when the current attempt started
  int new_dp_ = 0;          // the mesh.dp a shrink/grow fault asked for
  int processes_ = 0;       // ranks of the current attempt
  std::optional<StopSignals> stop_signals_;
  std::unique_ptr<MpirunStderr> mpirun_stderr_;  // the current attempt's, under mpi without child_stderr
  double fail_time_ = 0;
};

Supervision::Supervision(const SuperviseOptions& opt)
    : opt_(opt), s_(load_scenario(opt.scenario, opt.sets)), mpi_(opt.launcher == "mpi"),
      rng_(std::hash<std::string>{}(opt.scenario)) {
  planned_ = s_.faults;  // bad specs: exit 2 before anything runs
  for (const std::string& f : opt.faults) planned_.push_back(parse_fault(f));
  if (opt.launcher != "threads" && !mpi_) throw UserError("--launcher: 'threads' or 'mpi', got '" + opt.launcher + "'");
  if (mpi_) require_mpi("--launcher mpi");
  if (s_.ckpt.url.empty() || s_.ckpt.every <= 0)
    throw UserError("ckpt.url / ckpt.every: a supervised run restarts from committed checkpoints; set both "
                    "(e.g. --set ckpt.url=/tmp/run --set ckpt.every=5)");
  // One live job per prefix: the supervisor takes the lease for the whole
  // job (its children write under it, and restarts keep it), renews it,
  // and releases it when the job ends; an explicit --resume waits out a dead
  // holder's.
  lease_ = CheckpointLease::acquire(store(), new_job_id(), s_.ckpt.lease_seconds, !opt.resume.empty(),
                                    [](const std::string& m) { std::fprintf(stderr, "supervisor: %s\n", m.c_str()); });
  const char* tmp_root = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp_root && *tmp_root ? tmp_root : "/tmp") + "/lockstep-supervisor-XXXXXX";
  if (!mkdtemp(tmpl.data())) throw UserError("supervisor: cannot create a temporary directory under " + tmpl);
  dir_ = tmpl;
  stop_signals_.emplace();
  state_ = (dir_ / "faults.state").string();
  hb_ = (dir_ / "heartbeat").string();
  out_ = (dir_ / "child.out").string();
  step_log_ = (dir_ / "steps.log").string();
  job_started_ = now();
  // Where the job starts: the user's --resume, else what ckpt.url already
  // holds (said on the first line: an old run's checkpoints are resumed).
  user_resume_ = opt.resume.empty() ? -1 : resume_step(opt.resume, s_.ckpt.s3_endpoint);
  existing_ = latest_commit(s_.ckpt.url, s_.ckpt.s3_endpoint);
  if (opt.resume.empty() && existing_ >= 0)  // always: the run will not start from scratch
    std::fprintf(stderr,
                 "supervisor: ckpt.url %s already holds committed checkpoints (latest step %lld): the job resumes "
                 "from it (use a fresh ckpt.url to start from scratch)\n",
                 s_.ckpt.url.c_str(), (long long)existing_);
}

std::vector<std::string> Supervision::child_command() {
  const std::vector<int64_t> committed = committed_steps(*store());
  std::vector<std::string> args = {opt_.binary, "run", opt_.scenario, "--json",
                                   "--fault-state", state_, "--heartbeat", hb_, "--step-log", step_log_,
                                   "--supervisor-pid", std::to_string(::getpid()),
                                   "--lease", lease_->job() + ":" + std::to_string(lease_->generation())};
  // Neither flag: the child's own rule (a log's cadence when its stderr is not a terminal).
  if (opt_.child_progress) args.push_back("--progress");
  else if (opt_.child_quiet) args.push_back("--quiet");
  for (const std::string& x : opt_.sets) args.insert(args.end(), {"--set", x});
  for (const std::string& f : opt_.faults) args.insert(args.end(), {"--fault", f});
  if (new_dp_ > 0) {
    args.insert(args.end(), {"--set", "mesh.dp=" + std::to_string(new_dp_)});
    if (s_.mesh.ep > new_dp_) args.insert(args.end(), {"--set", "mesh.ep=" + std::to_string(new_dp_)});
    if (s_.mesh.fsdp && s_.mesh.replicate > 1 && new_dp_ % s_.mesh.replicate != 0)
      args.insert(args.end(), {"--set", "mesh.replicate=1"});
  }
  // This job's own commits in ckpt.url win once they pass the user's start.
  // With every one of them unusable, the job (not a user's --resume) starts over.
  if (!committed.empty() && committed.back() > user_resume_) {
    args.insert(args.end(), {"--resume", s_.ckpt.url});
    if (opt_.resume.empty()) args.push_back("--resume-fallback-start");
  } else if (!opt_.resume.empty()) {
    args.insert(args.end(), {"--resume", opt_.resume});
  }
  if (opt_.threads > 0) args.insert(args.end(), {"--threads", std::to_string(opt_.threads)});
  args.insert(args.end(), opt_.extra_args.begin(), opt_.extra_args.end());
  MeshConfig mesh = s_.mesh;
  if (new_dp_ > 0) mesh.dp = new_dp_;
  processes_ = mesh.world();  // one process per rank
  if (mpi_) {  // one rank per process: mpirun starts them
    const std::vector<std::string> launch = mpirun_command(processes_);
    args.insert(args.begin(), launch.begin(), launch.end());
  }
  return args;
}

pid_t Supervision::spawn(std::vector<std::string> args) {
  ::unlink(hb_.c_str());
  std::error_code ec;
  const uintmax_t logged = fs::file_size(step_log_, ec);
  attempt_log_from_ = ec ? 0 : (size_t)logged;  // this attempt's step records start here
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (!opt_.child_stderr.empty())
    posix_spawn_file_actions_addopen(&fa, 2, opt_.child_stderr.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  else if (mpi_) {  // mpirun's banners labelled on the way to the user's terminal
    mpirun_stderr_ = std::make_unique<MpirunStderr>();
    posix_spawn_file_actions_adddup2(&fa, mpirun_stderr_->child_end(), 2);
  }
  // The job in a session of its own: mpirun puts each rank in its own
  // process group, but they all stay in the session, so the session is
  // what the teardown kills.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  if (mpi_) posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID);
  pid_t pid;
  const int rc = posix_spawnp(&pid, argv[0], &fa, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) throw UserError(std::string("supervisor: cannot start ") + argv[0] + ": " + std::strerror(rc));
  if (mpirun_stderr_) mpirun_stderr_->start();
  return pid;
}

AttemptEnd Supervision::watch(pid_t pid) {
  AttemptEnd end;
  end.started = end.last_beat = now();
  int beat_step = -1;
  for (;;) {
    if (const int sig = stop_signal()) {
      // Ctrl-C, kill, a closed terminal: the job goes down with its
      // supervisor, before it exits, and commits nothing more.
      const int n = stop_job(pid, mpi_, sig);
      die_of_signal(sig, "stopped the job (" + std::to_string(n) + " process" + (n == 1 ? "" : "es") + ") at step " +
                             std::to_string(beat_step));
    }
    if (::waitpid(pid, &end.status, WNOHANG) == pid) break;
    struct stat st;
    int step_now = -1;
    std::ifstream(hb_) >> step_now;
    if (step_now != beat_step) {  // a new step started: progress
      beat_step = step_now;
      end.last_beat = now();
    }
    if (!pending_.is_null() && ::stat(hb_.c_str(), &st) == 0) settle_pending(true, now());
    if (now() - end.last_beat > opt_.heartbeat_timeout) {
      end.hung = true;
      if (mpi_) kill_session(pid);
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &end.status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  end.detected = now();
  // Whatever way the job ended, no rank process of it may live on into the
  // next attempt (or past the supervisor).
  end.orphans_killed = mpi_ ? kill_session(pid) : 0;
  mpirun_stderr_.reset();  // every process of the job is gone: its last lines are out
  // A resumed child that began a step, though it ended before a poll saw its
  // heartbeat (a short run on a busy machine), resumed: seen now. Without a
  // heartbeat it died before its first step.
  struct stat beat;
  if (!pending_.is_null()) settle_pending(::stat(hb_.c_str(), &beat) == 0, end.detected);
  return end;
}

void Supervision::settle_pending(bool resumed, double at) {
  if (resumed) {
    pending_["time_to_resume_seconds"] = at - fail_time_;
    pending_["resumed"] = true;
  } else {  // it resumed and replayed nothing
    pending_["time_to_resume_seconds"] = nullptr;
    pending_["resumed"] = false;
    pending_["steps_replayed"] = 0;
    pending_["time_to_failure_seconds"] = at - fail_time_;  // what was measured: until it was found dead
  }
  timeline_.push_back(pending_);
  pending_ = nullptr;
}

SuperviseResult Supervision::finished(int attempt) {
  SuperviseResult res;
  std::istringstream text(slurp(out_));
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
  const FiredFaults fired = read_fault_state(state_);
  res.summary["restarts"] = timeline_;
  res.summary["faults_fired"] = fired.lines;
  res.summary["attempts"] = attempt + 1;
  res.summary["wall_seconds"] = now() - job_started_;
  note_resumed_existing(res.summary);
  const int first = (int)(opt_.resume.empty() ? std::max<int64_t>(existing_, 0) : user_resume_) + 1;
  try {
    stitch_steps(step_log_, first, res.summary.value("steps", 0), (int64_t)s_.batch * s_.model.seq_len, res.summary);
  } catch (const std::exception& e) {
    res.exit_code = 3;
    res.error = e.what();
    return res;
  }
  if (res.summary.contains("resumed_from") && first > 1) res.summary["resumed_from"] = first - 1;
  else res.summary.erase("resumed_from");
  // A planned fault that never fired leaves the run unproven: say which.
  std::string missed;
  for (size_t i = 0; i < planned_.size(); ++i)
    if (!fired.indices.count((int)i)) missed += (missed.empty() ? "" : ", ") + planned_[i].text();
  if (!missed.empty()) {
    res.exit_code = 1;
    res.error = "the run finished but planned fault(s) never fired: " + missed +
                " (a threshold the checkpoint never reached, or a step the job resumed past)";
    res.summary["faults_not_fired"] = missed;
    return res;
  }
  nlohmann::json fallbacks = nlohmann::json::array();
  size_t from_start = 0;
  for (const std::string& l : new_lines(state_, from_start))
    if (l.rfind("fallback", 0) == 0) fallbacks.push_back(l);
  res.summary["restore_fallbacks"] = fallbacks;
  // A job that leaves a rotten checkpoint committed says so (a restore from it would fall back).
  res.summary["corrupt_checkpoints"] = corrupt_checkpoints_left(state_, *store());
  return res;
}

std::optional<SuperviseResult> Supervision::stop_or_plan_restart(const AttemptEnd& end, int attempt) {
  const std::vector<std::string> events = new_lines(state_, seen_);
  const std::string failure =
      end.hung ? "hang (no heartbeat for " + std::to_string((int)opt_.heartbeat_timeout) + " s)" : describe(end.status, mpi_);
  // The step the job was in when it failed (its heartbeat, written at each
  // step's start), and the last step it finished (its step log, written
  // before the step's checkpoint): a kill during a checkpoint's I/O fails
  // "at" the step that finished, whose checkpoint did not commit.
  int failed_step = 0;
  std::ifstream(hb_) >> failed_step;
  const int last_done = last_step_logged_since(step_log_, attempt_log_from_);
  failed_step = std::max(failed_step, last_done);
  const int code = end.exit_code();
  SuperviseResult res;
  if (code == 2 || code == 3 || code == kExitLeaseLost || code == kExitInternalError) {
    // Bad input, an unavailable store, another job on the prefix, or a bug
    // (it would recur): restarting cannot help.
    res.exit_code = code;
    res.error = "the job stopped (" + failure + ") at step " + std::to_string(failed_step) + "; not restarting: " +
                (code == 2                    ? "bad input"
                 : code == 3                  ? "the store failed"
                 : code == kExitInternalError ? "a bug in Lockstep"
                                              : "another job took the checkpoint lease") +
                "; committed checkpoints are intact";
    res.summary = {{"restarts", timeline_}, {"faults_fired", read_fault_state(state_).lines}};
    note_resumed_existing(res.summary);
    say(res.error);
    return res;
  }
  if (attempt >= opt_.max_restarts) {
    res.exit_code = 1;
    res.error = "restart budget exhausted after " + std::to_string(attempt) + " restarts (last: " + failure + ")";
    res.summary = {{"restarts", timeline_}};
    say(res.error);
    return res;
  }
  const FiredFaults fired = read_fault_state(state_);
  if (fired.new_dp > 0) new_dp_ = fired.new_dp;
  const std::vector<int64_t> now_committed = committed_steps(*store());
  const int64_t restore_step = now_committed.empty() ? 0 : now_committed.back();
  pending_ = {{"attempt", attempt + 1},
              {"failure", failure},
              {"events", events},
              {"failed_at_step", failed_step},
              {"detection_seconds", end.detected - std::max(end.last_beat, end.started)},
              {"restore_step", restore_step},
              {"steps_replayed", std::max<int64_t>(0, last_done - restore_step)},
              {"mesh_dp_after", new_dp_ > 0 ? new_dp_ : s_.mesh.dp}};
  if (mpi_) {
    pending_["processes"] = processes_;
    pending_["orphans_killed"] = end.orphans_killed;
  }
  announce(failure + " at step " + std::to_string(failed_step) + "; restarting from " +
      (restore_step ? "checkpoint " + std::to_string(restore_step) : std::string("scratch")) +
      (new_dp_ > 0 ? " on mesh.dp=" + std::to_string(new_dp_) : std::string()));
  fail_time_ = end.detected;
  return std::nullopt;
}

void Supervision::back_off(int attempt) {
  const double backoff = opt_.backoff_seconds * std::pow(2.0, std::min(attempt, 6)) *
                         (0.5 + 0.5 * std::uniform_real_distribution<double>(0, 1)(rng_));
  sleep_unless_stopped(backoff);
  if (const int sig = stop_signal()) die_of_signal(sig, "stopped between attempts");
}

// After a stop signal, once no process of the job is left: clean up, say
// so, and die of the signal, as a shell expects of an interrupted command.
void Supervision::die_of_signal(int sig, const std::string& what) {
  // Every process of the job is gone (stop_job, or between attempts), so
  // the stderr relay reads its end now: waited for, it does not outlive the
  // supervisor (a forked copy of it, it names the job's checkpoint URL too).
  mpirun_stderr_.reset();
  std::error_code ec;
  fs::remove_all(dir_, ec);
  lease_->release();
  const std::string next = opt_.on_stop ? opt_.on_stop()
                                        : "committed checkpoints in " + s_.ckpt.url +
                                              " are intact (continue with --resume " + s_.ckpt.url + ")";
  std::fprintf(stderr, "supervisor: %s: %s; %s\n", stop_signal_name(sig).c_str(), what.c_str(), next.c_str());
  ls::die_of_signal(sig);
}

}  // namespace

SuperviseResult supervise(const SuperviseOptions& opt) {
  Supervision job(opt);
  for (int attempt = 0;; ++attempt) {
    const AttemptEnd end = job.watch(job.spawn(job.child_command()));
    if (end.exited_ok()) return job.finished(attempt);
    if (std::optional<SuperviseResult> stopped = job.stop_or_plan_restart(end, attempt)) return *stopped;
    job.back_off(attempt);
  }
}

}  // namespace ls
