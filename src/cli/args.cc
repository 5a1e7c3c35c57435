#include "cli/args.h"

#include <filesystem>
#include <fstream>

#include "common/error.h"

namespace fs = std::filesystem;

namespace ls {
namespace {

std::vector<std::string> g_command_line;

}  // namespace

void keep_command_line(int argc, char** argv) { g_command_line.assign(argv, argv + argc); }

const std::vector<std::string>& command_line() { return g_command_line; }

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) throw UserError(path + ": cannot write file");
    out << text;
    if (!out) throw UserError(path + ": write failed");
  }
  fs::rename(tmp, path);
}

}  // namespace ls
