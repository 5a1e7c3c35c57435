// Errors caused by user input (scenario, flags, files). The CLI prints the
// message and exits with code 2; messages name the key, file or object.
// And errors that are Lockstep's own: a broken internal invariant
// (InternalError), exit code kExitInternalError.
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

// The exit code of a run stopped by an InternalError (EX_SOFTWARE of BSD's
// sysexits.h). A supervisor does not restart it: the same bug would recur.
constexpr int kExitInternalError = 70;

// An internal invariant that does not hold: a bug in Lockstep, whatever the
// input. what() is the invariant's message followed by a request to report
// the bug; invariant() is the message alone.
class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& invariant)
      : std::logic_error(invariant + " (this is a bug in Lockstep, not a problem with the input: please report it, "
                                     "with the command line and the scenario that led to it)"),
        invariant_(invariant) {}
  const std::string& invariant() const { return invariant_; }

 private:
  std::string invariant_;
};

}  // namespace ls
