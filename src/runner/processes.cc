#include "runner/processes.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

namespace ls {
namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

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

}  // namespace ls
