// Which of a trainer's ranks this process holds: the saving side writes the
// objects of those ranks, the restoring side fills their state. Internal to
// src/ckpt.
#pragma once

#include <algorithm>

#include "cluster/communicator.h"

namespace ls {

// Whether this process holds trainer rank r of `ranks`: each process holds an
// even block of them (under MPI one each; alone, all).
inline bool holds_rank(const Communicator& processes, int ranks, int r) {
  return r / std::max(1, ranks / processes.size()) == processes.rank();
}

}  // namespace ls
