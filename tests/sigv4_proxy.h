// The SigV4-checking proxy (tests/sigv4_proxy.py) in front of an s3rver, for
// tests: every request through it is verified with botocore's signer, and
// the test reads back what it saw (requests, failures).
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "s3rver.h"

namespace lstest {

// A Python 3 that imports every module in `modules` (e.g. "botocore"):
// $LOCKSTEP_PYTHON, else python3 on PATH, else Debian's /usr/bin/python3
// (where scripts/install-deps.sh puts python3-botocore and friends). "" if none.
inline std::string python_with(const std::string& modules) {
  std::vector<std::string> cands;
  if (const char* p = std::getenv("LOCKSTEP_PYTHON")) cands.emplace_back(p);
  cands.emplace_back("python3");
  cands.emplace_back("/usr/bin/python3");
  for (const std::string& py : cands) {
    const std::string cmd = py + " -c 'import " + modules + "' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return "";
}

struct ProxyRequest {
  std::string method, path, error, signed_headers, payload;
  bool ok = true;
  uint64_t bytes = 0;  // body
  int in_flight = 0;   // requests the proxy was handling when this one arrived, itself included
};

struct SigV4Proxy {
  SigV4Proxy() = default;
  SigV4Proxy(const SigV4Proxy&) = delete;
  SigV4Proxy& operator=(const SigV4Proxy&) = delete;
  pid_t pid = -1;
  int port = 0;
  fs::path dir;

  static std::string script() { return std::string(LOCKSTEP_SOURCE_DIR) + "/tests/sigv4_proxy.py"; }

  // Extra proxy flags (--inject-list-key K, --tamper-put), set before start.
  std::vector<std::string> flags;

  // Starts the proxy in front of `upstream` (http://host:port) checking
  // signatures made with the given credentials.
  void start(const std::string& upstream, const std::string& access = "S3RVER", const std::string& secret = "S3RVER",
             const std::string& region = "us-east-1") {
    const std::string py = python_with("botocore");
    if (py.empty()) throw std::runtime_error("no python3 with botocore: run scripts/install-deps.sh");
    char tmpl[] = "/tmp/lockstep-sigv4-XXXXXX";
    dir = fs::path(mkdtemp(tmpl));
    const fs::path port_file = dir / "port";
    std::vector<std::string> args = {py, script(), "--upstream", upstream, "--port-file", port_file.string(),
                                     "--log", (dir / "log.jsonl").string(), "--access-key", access,
                                     "--secret-key", secret, "--region", region};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string errf = (dir / "stderr.txt").string();
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, errf.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const int rc = posix_spawnp(&pid, py.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid = -1;
      throw std::runtime_error("cannot start " + script() + ": " + std::strerror(rc));
    }
    const auto t0 = std::chrono::steady_clock::now();
    while (!fs::exists(port_file)) {
      int st;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        throw std::runtime_error("sigv4_proxy exited at start:\n" + slurp(errf));
      }
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(20))
        throw std::runtime_error("sigv4_proxy did not start within 20 s:\n" + slurp(errf));
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
    }
    port = std::stoi(slurp(port_file.string()));
  }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port); }

  static std::string slurp(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // Every request the proxy has seen so far, in arrival order.
  std::vector<ProxyRequest> requests() const {
    std::vector<ProxyRequest> out;
    std::ifstream in(dir / "log.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      const nlohmann::json j = nlohmann::json::parse(line);
      ProxyRequest r;
      r.method = j["method"];
      r.path = j["path"];
      r.ok = j["ok"];
      if (j["error"].is_string()) r.error = j["error"];
      if (j["signed_headers"].is_string()) r.signed_headers = j["signed_headers"];
      if (j["payload"].is_string()) r.payload = j["payload"];
      r.bytes = j["bytes"];
      r.in_flight = j["in_flight"];
      out.push_back(r);
    }
    return out;
  }

  // The failed checks, one line each ("METHOD PATH: why").
  std::vector<std::string> failures() const {
    std::vector<std::string> out;
    for (const ProxyRequest& r : requests())
      if (!r.ok) out.push_back(r.method + " " + r.path + ": " + r.error);
    return out;
  }

  // Fails the current test for every failed check so far.
  void check_clean() const {
    const auto f = failures();
    for (const std::string& x : f) FAIL_CHECK("sigv4_proxy: " << x);
    CHECK(f.empty());
  }

  ~SigV4Proxy() {
    stop_child(pid);
    std::error_code ec;
    if (std::getenv("LOCKSTEP_KEEP_S3RVER")) MESSAGE("sigv4_proxy log kept in " << dir.string());
    else if (!dir.empty()) fs::remove_all(dir, ec);
  }
};

}  // namespace lstest
