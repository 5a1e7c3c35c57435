// The launcher's side of cluster/mpi.h: it needs no MPI library, so builds
// with and without MPI share it.
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cluster/mpi.h"

namespace ls {

bool launched_by_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

std::vector<std::string> mpirun_command(int np) {
  std::vector<std::string> cmd = {"mpirun"};
  if (geteuid() == 0) cmd.push_back("--allow-run-as-root");
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (np > cores) cmd.push_back("--oversubscribe");
  cmd.push_back("-np");
  cmd.push_back(std::to_string(np));
  return cmd;
}

}  // namespace ls
