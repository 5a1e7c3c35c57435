// Errors caused by user input (scenario, flags, files). The CLI prints the
// message and exits with code 2; messages name the key, file or object.
#pragma once

#include <stdexcept>
#include <string>

namespace ls {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A checkpoint whose bytes are bad, as found on reading it back: a checksum
// mismatch, a torn or malformed manifest, a corrupt safetensors object, an
// object the manifest names that is missing, pieces that do not hold what
// the manifest says. A resume falls back to an older checkpoint on this
// kind only; any other UserError (an input mistake) stops it. Still bad
// input to the CLI: exit code 2.
struct CorruptCheckpoint : UserError {
  using UserError::UserError;
};

// A broken internal invariant: a bug in Lockstep, not bad input. The CLI
// says so, asks for a bug report and exits with its own code (70).
struct InternalError : std::logic_error {
  explicit InternalError(const std::string& what)
      : std::logic_error(what + " (an internal error: a bug in Lockstep; please report it with the command that ran)") {}
};

}  // namespace ls
