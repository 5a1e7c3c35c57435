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

}  // namespace ls
