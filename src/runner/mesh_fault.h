// `lockstep run --debug-mesh-fault KIND`: one bit flipped once a step in one
// message of one group of the mesh, so that tests can show the drift tools
// (diff, bisect, report) find it. The fault is a FaultyCommunicator
// (cluster/faulty_communicator.h) the runner puts on the named group of the
// rank it hits; the algorithms that send the message know nothing of it.
// Each is planted on one rank:
//   tp_chain       the tensor group's last rank, on the first finished chain output it sends or broadcasts
//   cp_handoff     context-parallel rank 0, on the first dK/dV rows it hands on
//   pp_activation  pipeline stage 1, on the first activation it receives
//   ep_row         expert-parallel rank 1, on the first row another rank dispatches to it
//   fsdp_block     shard rank 1, on its first reduce-scattered gradient block (its top mantissa bit:
//                  AdamW's moments absorb a one-ulp gradient error, so the last bit would leave the state alone)
// A group the fault names goes by messages, not through shared memory
// (mesh.shared_memory): the bits are the same either way, and a shared
// region has no message to flip.
#pragma once

#include <memory>

#include "cluster/faulty_communicator.h"
#include "cluster/mesh.h"

namespace ls {

enum class MeshFault { kNone, kTpChain, kCpHandoff, kPpActivation, kEpRow, kFsdpBlock };

// Puts the fault's FaultyCommunicator on its group of `mesh` when this rank
// is the one it hits, made anew in *tap unless *tap is there already (a mesh
// kept from call to call: MPI). The caller keeps *tap as long as the mesh.
// `armed`: set once a step to plant it again.
void tap_mesh_fault(MeshFault f, Mesh& mesh, bool* armed, std::unique_ptr<FaultyCommunicator>* tap);

}  // namespace ls
