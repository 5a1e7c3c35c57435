// The Communicator over MPI: one rank per process, as many processes as the
// mesh has ranks, started by mpirun (docs/CLUSTER.md). Sums never use an MPI
// reduction: partials move as data (all-to-all, all-gather) and every rank
// combines them by the contract's canonical tree over rank index, exactly as
// the in-process communicator does, so the bits are the same.
#pragma once

#include <string>
#include <vector>

#include "cluster/communicator.h"

namespace ls {

// Whether this build has MPI (meson found it; scripts/install-deps.sh installs Open MPI).
bool mpi_available();
// Without MPI: UserError "<what>: this lockstep was built without MPI (how to
// get it)". With MPI: nothing.
void require_mpi(const std::string& what);
// True when this process runs under mpirun (Open MPI's environment).
bool launched_by_mpirun();
// The mpirun command line that starts `np` processes here: Open MPI's flags
// for running as root only when we are root, for more processes than cores
// only when there are more, no core binding for one process (it gets the
// threads launcher's default, every core); the program and its arguments follow.
std::vector<std::string> mpirun_command(int np);
// This process's MPI world: MPI_Init on the first call, MPI_Finalize at exit.
// Errors of every call become exceptions naming the collective. Without MPI:
// UserError.
Communicator& mpi_world();

}  // namespace ls
