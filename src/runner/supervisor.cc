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
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "ckpt/checkpointer.h"
#include "common/error.h"
#include "faults/injector.h"
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
  return "exit " + std::to_string(code);
}

}  // namespace

SuperviseResult supervise(const SuperviseOptions& opt) {
  const Scenario s = load_scenario(opt.scenario, opt.sets);
  for (const std::string& f : opt.faults) parse_fault(f);  // bad specs: exit 2 before anything runs
  if (s.ckpt.url.empty() || s.ckpt.every <= 0)
    throw UserError("ckpt.url / ckpt.every: a supervised run restarts from committed checkpoints; set both "
                    "(e.g. --set ckpt.url=/tmp/run --set ckpt.every=5)");
  char tmpl[] = "/tmp/lockstep-supervisor-XXXXXX";
  if (!mkdtemp(tmpl)) throw UserError("supervisor: cannot create a temporary directory");
  const fs::path dir = tmpl;
  const std::string state = (dir / "faults.state").string(), hb = (dir / "heartbeat").string(),
                    out = (dir / "child.out").string();
  std::mt19937_64 rng(std::hash<std::string>{}(opt.scenario));
  SuperviseResult res;
  nlohmann::json timeline = nlohmann::json::array();
  nlohmann::json pending;  // the restart whose child has not shown a heartbeat yet
  size_t seen = 0;
  int new_dp = 0, attempt = 0;
  double fail_time = 0;
  auto say = [&](const std::string& m) {
    if (opt.progress) std::fprintf(stderr, "supervisor: %s\n", m.c_str());
  };
  for (;; ++attempt) {
    std::unique_ptr<ObjectStore> store = open_store(s.ckpt.url, StoreOptions{s.ckpt.s3_endpoint});
    const std::vector<int64_t> committed = committed_steps(*store);
    std::vector<std::string> args = {opt.binary, "run", opt.scenario, "--json", "--quiet", "--fault-state", state,
                                     "--heartbeat", hb};
    for (const std::string& x : opt.sets) args.insert(args.end(), {"--set", x});
    for (const std::string& f : opt.faults) args.insert(args.end(), {"--fault", f});
    if (new_dp > 0) {
      args.insert(args.end(), {"--set", "mesh.dp=" + std::to_string(new_dp)});
      if (s.mesh.ep > new_dp) args.insert(args.end(), {"--set", "mesh.ep=" + std::to_string(new_dp)});
      if (s.mesh.fsdp && s.mesh.replicate > 1 && new_dp % s.mesh.replicate != 0)
        args.insert(args.end(), {"--set", "mesh.replicate=1"});
    }
    if (!committed.empty()) args.insert(args.end(), {"--resume", s.ckpt.url});
    if (opt.threads > 0) args.insert(args.end(), {"--threads", std::to_string(opt.threads)});
    args.insert(args.end(), opt.extra_args.begin(), opt.extra_args.end());
    ::unlink(hb.c_str());

    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (!opt.child_stderr.empty())
      posix_spawn_file_actions_addopen(&fa, 2, opt.child_stderr.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    pid_t pid;
    const int rc = posix_spawn(&pid, opt.binary.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw UserError("supervisor: cannot start " + opt.binary);
    const double started = now();
    double last_beat = started;
    bool hung = false;
    int status = 0;
    int beat_step = -1;
    for (;;) {
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
        timeline.push_back(pending);
        pending = nullptr;
      }
      if (now() - last_beat > opt.heartbeat_timeout) {
        hung = true;
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const double detected = now();
    if (!pending.is_null()) {  // the child died before its first step
      pending["time_to_resume_seconds"] = nullptr;
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
      res.summary["restarts"] = timeline;
      res.summary["faults_fired"] = read_fault_state(state).lines;
      nlohmann::json fallbacks = nlohmann::json::array();
      size_t from_start = 0;
      for (const std::string& l : new_lines(state, from_start))
        if (l.rfind("fallback", 0) == 0) fallbacks.push_back(l);
      res.summary["restore_fallbacks"] = fallbacks;
      fs::remove_all(dir);
      return res;
    }
    const std::string failure = hung ? "hang (no heartbeat for " + std::to_string((int)opt.heartbeat_timeout) + " s)"
                                     : describe(status);
    int failed_step = 0;
    std::ifstream(hb) >> failed_step;
    if (!hung && WIFEXITED(status) && (WEXITSTATUS(status) == 2 || WEXITSTATUS(status) == 3)) {
      // Bad input or an unavailable store: restarting cannot help.
      res.exit_code = WEXITSTATUS(status);
      res.error = "the job stopped (" + failure + ") at step " + std::to_string(failed_step) +
                  "; not restarting: " + (res.exit_code == 2 ? "bad input" : "the store failed") +
                  "; committed checkpoints are intact";
      res.summary = {{"restarts", timeline}, {"faults_fired", read_fault_state(state).lines}};
      say(res.error);
      fs::remove_all(dir);
      return res;
    }
    if (attempt >= opt.max_restarts) {
      res.exit_code = 1;
      res.error = "restart budget exhausted after " + std::to_string(attempt) + " restarts (last: " + failure + ")";
      res.summary = {{"restarts", timeline}};
      say(res.error);
      fs::remove_all(dir);
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
    say(failure + " at step " + std::to_string(failed_step) + "; restarting from " +
        (restore_step ? "checkpoint " + std::to_string(restore_step) : std::string("scratch")) +
        (new_dp > 0 ? " on mesh.dp=" + std::to_string(new_dp) : std::string()));
    fail_time = detected;
    const double backoff = opt.backoff_seconds * std::pow(2.0, std::min(attempt, 6)) *
                           (0.5 + 0.5 * std::uniform_real_distribution<double>(0, 1)(rng));
    std::this_thread::sleep_for(std::chrono::duration<double>(backoff));
  }
}

}  // namespace ls
