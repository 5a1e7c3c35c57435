#include "runner/processes.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace ls {
namespace {

// The whole of a /proc file, or "" when it cannot be read. A process may exit
// between the open and the read, and read() then fails (ESRCH): that process
// is gone, not an error. POSIX reads here, because libstdc++'s
// istreambuf_iterator throws on a failed read() whatever the stream's
// exception mask.
std::string read_proc_file(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, (size_t)n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      if (n < 0) out.clear();  // vanished mid-read: as if never there
      break;
    }
  }
  ::close(fd);
  return out;
}

// Calls f(pid, session, /proc/PID directory) for every live (non-zombie)
// process but this one. Linux /proc.
template <class F>
void for_each_live_process(F&& f) {
  // The non-throwing iteration: entries vanish while it walks.
  std::error_code ec;
  for (fs::directory_iterator it("/proc", ec), end; !ec && it != end; it.increment(ec)) {
    const fs::directory_entry& e = *it;
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const int pid = std::atoi(name.c_str());
    if (pid == ::getpid()) continue;
    // /proc/PID/stat: pid (comm) state ppid pgrp session ...; comm may hold spaces.
    const std::string stat = read_proc_file(e.path() / "stat");
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
    const std::string cmdline = read_proc_file(dir / "cmdline");
    if (cmdline.find(text) != std::string::npos) out.push_back(pid);
  });
  return out;
}

}  // namespace ls
