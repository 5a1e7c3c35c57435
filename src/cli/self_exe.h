// The path of the running lockstep binary: what supervisors, bisect and
// sweeps start as child processes.
#pragma once

#include <unistd.h>

#include <string>

#include "common/error.h"

namespace ls {

inline std::string self_executable() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw UserError("cannot find the lockstep binary (/proc/self/exe)");
  buf[n] = 0;
  return buf;
}

}  // namespace ls
