#include "runner/mpirun_stderr.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/error.h"

namespace ls {
namespace {

// The relay runs in a child forked from a process with threads: only
// async-signal-safe calls (read, write, _exit), no allocation.
void write_all(const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(2, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // stderr gone: drop the rest
    p += w;
    n -= (size_t)w;
  }
}

struct Relay {
  char line[8192];
  size_t len = 0;
  bool in_banner = false;  // between two of Open MPI's rules

  // Open MPI draws a banner between two rules of dashes.
  bool is_rule() const {
    if (len < 20) return false;
    for (size_t i = 0; i < len; ++i)
      if (line[i] != '-') return false;
    return true;
  }
  void end_line() {
    if (is_rule()) {
      in_banner = !in_banner;
    } else if (!(in_banner && len == 0)) {
      if (in_banner) write_all("mpirun: ", 8);
      write_all(line, len);
      write_all("\n", 1);
    }
    len = 0;
  }
  void take(const char* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (p[i] == '\n') {
        end_line();
      } else {
        if (len == sizeof line) {  // an overlong line goes out in pieces, as it is
          write_all(line, len);
          len = 0;
        }
        line[len++] = p[i];
      }
    }
  }
};

[[noreturn]] void relay(int in) {
  static Relay r;
  static char buf[65536];
  for (;;) {
    const ssize_t n = ::read(in, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    r.take(buf, (size_t)n);
  }
  if (r.len > 0) r.end_line();
  ::_exit(0);
}

}  // namespace

MpirunStderr::MpirunStderr() {
  if (::pipe2(fds_, O_CLOEXEC) != 0) throw UserError(std::string("supervisor: cannot make a pipe: ") + std::strerror(errno));
}

MpirunStderr::~MpirunStderr() {
  for (int& fd : fds_)
    if (fd >= 0) ::close(fd);
  if (relay_ > 0)
    while (::waitpid(relay_, nullptr, 0) < 0 && errno == EINTR) {
    }
}

void MpirunStderr::start() {
  relay_ = ::fork();
  if (relay_ == 0) {
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::signal(sig, SIG_IGN);  // it ends at the job's end, not before
    ::close(fds_[1]);
    relay(fds_[0]);
  }
  ::close(fds_[0]);
  ::close(fds_[1]);
  fds_[0] = fds_[1] = -1;
  if (relay_ < 0) throw UserError(std::string("supervisor: cannot start the stderr relay: ") + std::strerror(errno));
}

}  // namespace ls
