// Runs the lockstep binary as a user would, for the CLI suites: exit code,
// stdout and stderr of one command line, in a per-process temporary folder.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

namespace lstest {

struct CliResult {
  int rc;  // exit status; 128 + N when the shell saw signal N
  std::string out, err;
};

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::filesystem::path cli_temp_dir() {
  static std::filesystem::path dir = [] {
    char tmpl[] = "/tmp/lockstep-cli-XXXXXX";
    return std::filesystem::path(mkdtemp(tmpl));
  }();
  return dir;
}

// `args` goes through /bin/sh: quote what needs it.
inline CliResult run_cli(const std::string& args) {
  const std::filesystem::path out = cli_temp_dir() / "stdout", err = cli_temp_dir() / "stderr";
  const std::string cmd = std::string(LOCKSTEP_BIN) + " " + args + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), slurp(out), slurp(err)};
}

// The --json summary: the last line of a command's stdout.
inline nlohmann::json last_json(std::string out) {
  while (!out.empty() && out.back() == '\n') out.pop_back();
  const size_t nl = out.rfind('\n');
  return nlohmann::json::parse(nl == std::string::npos ? out : out.substr(nl + 1));
}

// An empty path under the suite's temporary folder (removed if present).
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path d = cli_temp_dir() / name;
  std::filesystem::remove_all(d);
  return d;
}

inline std::filesystem::path write_temp(const std::string& name, const std::string& text) {
  const std::filesystem::path p = cli_temp_dir() / name;
  std::filesystem::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

}  // namespace lstest
