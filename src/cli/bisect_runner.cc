#include "cli/bisect_runner.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "runner/runner.h"

extern char** environ;

namespace fs = std::filesystem;

namespace ls::bisect {

Runner::~Runner() {
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

Child Runner::run(const Side& side, int steps, const std::string& trace, const std::string& dump) {
  const fs::path sc = dir_ / ("scenario-" + std::to_string(n_) + ".json");
  const fs::path out = dir_ / "child.out", err = dir_ / "child.err";
  ++n_;
  std::ofstream(sc) << side.resolved.dump(2);
  std::vector<std::string> args = {side.binary, "run", sc.string(), "--json", "--quiet", "--steps",
                                   std::to_string(steps), "--backend", side.backend};
  if (side.threads > 0) args.insert(args.end(), {"--threads", std::to_string(side.threads)});
  if (!side.mesh_fault.empty()) args.insert(args.end(), {"--debug-mesh-fault", side.mesh_fault});
  if (side.launcher == "mpi" && mesh_from_json(side.resolved.value("mesh", nlohmann::json::object())).world() > 1)
    args.insert(args.end(), {"--launcher", "mpi"});  // `run` starts mpirun, one process per rank
  if (!trace.empty()) args.insert(args.end(), {"--trace", trace});
  if (!dump.empty()) args.insert(args.end(), {"--trace-dump", dump});
  const int status = wait_for(spawn(args, out, err));
  ++runs_;
  Child c;
  c.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  c.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  std::ifstream eo(err);
  std::stringstream es;
  es << eo.rdbuf();
  c.err = es.str();
  if (c.rc == 0) {
    std::ifstream o(out);
    std::string line, last;
    while (std::getline(o, line))
      if (!line.empty()) last = line;
    c.summary = nlohmann::json::parse(last);
  }
  return c;
}

pid_t Runner::spawn(const std::vector<std::string>& args, const fs::path& out, const fs::path& err) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw UserError("bisect: cannot start " + args[0] + ": " + std::strerror(rc));
  return pid;
}

// The child's wait status. A stop signal to this process is passed on to
// the child (a terminal's Ctrl-C reaches both already), and once the child
// is gone, the bisect ends: Interrupted, so the temporary directory goes.
int Runner::wait_for(pid_t pid) const {
  // Polled: a signal that lands before a blocking waitpid() starts (while
  // posix_spawn returns, say) would not interrupt it.
  int status = 0;
  bool passed_on = false;
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) throw UserError(std::string("bisect: waiting for a run: ") + std::strerror(errno));
    if (const int sig = stop_signal(); sig && !passed_on) {
      ::kill(pid, sig);
      passed_on = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (const int sig = stop_signal())
    throw Interrupted(sig, "bisect: " + stop_signal_name(sig) + ": stopped during its run " +
                               std::to_string(runs_ + 1) + "; nothing was concluded");
  return status;
}

}  // namespace ls::bisect
