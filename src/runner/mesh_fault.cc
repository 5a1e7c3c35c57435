#include "runner/mesh_fault.h"

namespace ls {
namespace {

// Where a fault sits: its group, the rank of that group it hits (-1: the
// last), and the message it flips there.
struct Rule {
  MeshFault fault;
  Axis axis;
  int rank;
  MessageFault message;
};

const Rule kRules[] = {
    // The chain's last segment owner sends each rank its rows (sequence parallel) or broadcasts the output.
    {MeshFault::kTpChain, Axis::kTensor, -1, {MessageFault::kSend | MessageFault::kBroadcast, nullptr, 0}},
    {MeshFault::kCpHandoff, Axis::kContext, 0, {MessageFault::kSend, nullptr, 0}},
    {MeshFault::kPpActivation, Axis::kPipeline, 1, {MessageFault::kRecv, nullptr, 0}},
    // The expert group's all-to-alls carry routing counts and leaf ids too: only the rows to their owners.
    {MeshFault::kEpRow, Axis::kExpert, 1, {MessageFault::kAllToAll, "ep_dispatch", 0}},
    {MeshFault::kFsdpBlock, Axis::kShard, 1, {MessageFault::kReduceScatter, nullptr, 22}},
};

}  // namespace

void tap_mesh_fault(MeshFault f, Mesh& mesh, bool* armed, std::unique_ptr<FaultyCommunicator>* tap) {
  for (const Rule& r : kRules) {
    if (r.fault != f) continue;
    Communicator& group = mesh.group(r.axis);
    if (&group == tap->get()) return;
    if (group.rank() != (r.rank < 0 ? group.size() + r.rank : r.rank)) return;
    *tap = std::make_unique<FaultyCommunicator>(group, r.message, armed);
    mesh.set_group(r.axis, tap->get());
  }
}

}  // namespace ls
