// Errors caused by user input (scenario, flags, files). The CLI prints the
// message and exits with code 2; messages name the key, file or object.
#pragma once

#include <stdexcept>
#include <string>

namespace ls {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace ls
