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
  // Open MPI binds each of up to 2 processes to one core, and OpenMP then
  // sees one: a one-process job would run 1 thread where the threads
  // launcher runs one per core. Unbound, it uses the same default. (Two or
  // more processes keep the binding: a core each, not every core each.)
  if (np == 1) cmd.insert(cmd.end(), {"--bind-to", "none"});
  cmd.push_back("-np");
  cmd.push_back(std::to_string(np));
  return cmd;
}

}  // namespace ls
