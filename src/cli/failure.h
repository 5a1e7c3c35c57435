// How the CLI reports the exception that ended a command: one line for
// stderr and the exit code (README.md, "Exit codes"): 2 bad input
// (UserError), 3 the store failed (StoreError) or another unexpected
// exception, kExitLeaseLost another job took the checkpoint lease,
// kExitInternalError a bug in Lockstep (InternalError), 128 + the signal a
// command stopped by SIGINT/SIGTERM/SIGHUP (Interrupted) dies of.
#pragma once

#include <exception>
#include <string>

namespace ls {

struct Failure {
  int exit_code = 0;
  std::string message;  // "lockstep: ...", without the newline
  int signal = 0;       // Interrupted: the signal to die of once the message is out
};

// error: a std::exception (of any kind) thrown out of a command.
Failure describe_failure(std::exception_ptr error);

}  // namespace ls
