#include "cli/mpirun.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include "cli/args.h"
#include "cli/self_exe.h"
#include "cluster/mpi.h"
#include "common/error.h"
#include "common/stop_signals.h"
#include "contract.h"
#include "runner/golden.h"
#include "runner/processes.h"

namespace fs = std::filesystem;

namespace ls {

// --launcher mpi: runs `mpirun -np <world> lockstep ...` with the same
// arguments (less --launcher), one rank per process, and ends as it ends.
// mpirun stopped by a signal exits 1 without a word, and 1 means "found a
// difference" here; so the job runs in a session of its own (a terminal's
// Ctrl-C reaches this process alone), and a stop signal is handed on to
// every process of it, then this process says so in one line and dies of
// the signal, as the threads launcher and the supervisor do (130, 143).
[[noreturn]] void launch_under_mpirun(const Scenario& s, const char* self) {
  require_mpi("--launcher mpi");
  const std::vector<std::string>& args = command_line();
  std::vector<std::string> cmd = mpirun_command(s.mesh.world());
  cmd.push_back(self);
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--launcher") {
      ++i;
      continue;
    }
    if (args[i].rfind("--launcher=", 0) == 0) continue;
    cmd.push_back(args[i]);
  }
  // A rank's stderr is mpirun's pipe, not this terminal: rank 0 would keep
  // to a log's cadence. At a terminal it shows progress as a threads run does.
  if (isatty(2) && std::find(args.begin(), args.end(), "--quiet") == args.end() &&
      std::find(args.begin(), args.end(), "--progress") == args.end())
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
    const std::string m =
        std::string("lockstep: error: --launcher mpi: cannot start mpirun: ") + std::strerror(errno) + "\n";
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
                 s.ckpt.url.empty() ? ""
                                    : ("; committed checkpoints in " + s.ckpt.url +
                                       " are intact (continue with --resume " + s.ckpt.url + ")")
                                          .c_str());
    die_of_signal(sig);
  }
  std::fflush(nullptr);
  if (WIFSIGNALED(status)) std::_Exit(128 + WTERMSIG(status));
  std::_Exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
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

}  // namespace ls
