// cluster/mpi.h in a build without MPI (meson compiles this file instead of
// mpi.cc): every way into MPI says how to get it.
#include "cluster/mpi.h"

#include <string>

#include "common/error.h"

namespace ls {

bool mpi_available() { return false; }

void require_mpi(const std::string& what) {
  throw UserError(what + ": this lockstep was built without MPI (install libopenmpi-dev via "
                         "scripts/install-deps.sh, then meson setup --reconfigure build)");
}

Communicator& mpi_world() {
  throw UserError("this lockstep was built without MPI: install libopenmpi-dev (scripts/install-deps.sh) and "
                  "reconfigure the build (meson setup --reconfigure build)");
}

}  // namespace ls
