// A real S3 server for tests: s3rver (installed by scripts/install-deps.sh
// under .s3rver/) on a free loopback port with bucket "lockstep".
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace lstest {

namespace fs = std::filesystem;

// SIGTERM, up to 2 s to exit, then SIGKILL; reaps the child either way.
inline void stop_child(pid_t& pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  int st;
  for (int i = 0; i < 100 && ::waitpid(pid, &st, WNOHANG) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (::waitpid(pid, &st, WNOHANG) == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &st, 0);
  }
  pid = -1;
}

// An s3rver on a free local port with bucket "lockstep", stopped (and its
// directory removed) when this goes out of scope, test failure included.
struct S3rver {
  S3rver() = default;
  S3rver(const S3rver&) = delete;
  S3rver& operator=(const S3rver&) = delete;
  pid_t pid = -1;
  int port = 0;
  fs::path dir;

  static std::string binary() { return std::string(LOCKSTEP_SOURCE_DIR) + "/.s3rver/node_modules/.bin/s3rver"; }

  static int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(fd);
    return ntohs(a.sin_port);
  }

  static bool accepts(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    return ok;
  }

  std::string log() const {
    std::ifstream in(dir / "s3rver.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  void start() {
    char tmpl[] = "/tmp/lockstep-s3rver-XXXXXX";
    dir = fs::path(mkdtemp(tmpl));
    fs::create_directories(dir / "data");
    port = free_port();
    const std::string bin = binary(), data = (dir / "data").string(), p = std::to_string(port),
                      logf = (dir / "s3rver.log").string();
    // s3rver 3.7.1 makes continuation tokens with DES, which Node 17+ only
    // has with OpenSSL's legacy provider.
    std::vector<std::string> env = {"NODE_OPTIONS=--openssl-legacy-provider"};
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "NODE_OPTIONS=", 13) != 0) env.emplace_back(*e);
    std::vector<char*> envp, argv;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = {bin, "-d", data, "-a", "127.0.0.1", "-p", p, "--configure-bucket", "lockstep"};
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, logf.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const int rc = posix_spawn(&pid, bin.c_str(), &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid = -1;
      throw std::runtime_error("cannot start " + bin + ": " + std::strerror(rc));
    }
    const auto t0 = std::chrono::steady_clock::now();
    while (!accepts(port)) {
      int st;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        throw std::runtime_error("s3rver exited at start:\n" + log());
      }
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(10))
        throw std::runtime_error("s3rver did not accept connections within 10 s:\n" + log());
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port); }

  ~S3rver() {
    stop_child(pid);
    std::error_code ec;
    // LOCKSTEP_KEEP_S3RVER=1 keeps the server's data and log for debugging.
    if (std::getenv("LOCKSTEP_KEEP_S3RVER")) MESSAGE("s3rver data and log kept in " << dir.string());
    else if (!dir.empty()) fs::remove_all(dir, ec);
  }
};

inline void set_s3_credentials() {
  setenv("AWS_ACCESS_KEY_ID", "S3RVER", 1);
  setenv("AWS_SECRET_ACCESS_KEY", "S3RVER", 1);
}

}  // namespace lstest
