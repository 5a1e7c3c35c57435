#include "runner/mpirun_stderr.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/error.h"

namespace ls {
namespace {

// Open MPI draws a banner between two rules of dashes.
bool is_rule(const std::string& line) {
  return line.size() >= 20 && line.find_first_not_of('-') == std::string::npos;
}

}  // namespace

MpirunStderr::MpirunStderr() {
  if (::pipe2(fds_, O_CLOEXEC) != 0) throw UserError(std::string("supervisor: cannot make a pipe: ") + std::strerror(errno));
}

MpirunStderr::~MpirunStderr() {
  if (fds_[1] >= 0) ::close(fds_[1]);
  if (relay_.joinable()) relay_.join();
  else if (fds_[0] >= 0) ::close(fds_[0]);
}

void MpirunStderr::start() {
  ::close(fds_[1]);
  fds_[1] = -1;
  relay_ = std::thread([fd = fds_[0]] {
    FILE* in = ::fdopen(fd, "r");
    if (!in) {
      ::close(fd);
      return;
    }
    bool in_banner = false;
    char* line = nullptr;
    size_t cap = 0;
    for (ssize_t n; (n = ::getline(&line, &cap, in)) > 0;) {
      std::string text(line, (size_t)n);
      while (!text.empty() && text.back() == '\n') text.pop_back();
      if (is_rule(text)) {
        in_banner = !in_banner;
        continue;
      }
      if (in_banner && text.empty()) continue;
      std::fprintf(stderr, "%s%s\n", in_banner ? "mpirun: " : "", text.c_str());
    }
    std::free(line);
    std::fclose(in);
  });
}

}  // namespace ls
