// One rank's place in the mesh: a communicator per axis (config.h's Axis),
// split from the world by the rank's coordinates. A one-rank mesh has a
// one-rank communicator on every axis, so code that folds or gathers over
// a group runs the same algorithm whether or not it has peers.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "cluster/communicator.h"
#include "cluster/config.h"

namespace ls {

struct SharedChain;  // cluster/shared_chain.h

class Mesh {
 public:
  // One rank: every group is this rank alone.
  Mesh();
  // world.rank()'s groups under cfg. A collective: every rank of world
  // makes its Mesh together (each split is one).
  Mesh(const MeshConfig& cfg, Communicator& world);
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  Communicator& group(Axis a) const { return *groups_[(size_t)a]; }
  int size(Axis a) const { return group(a).size(); }
  int rank(Axis a) const { return group(a).rank(); }
  // Sequence parallel: the stream's tokens are split across the tensor
  // group, so a sum over them spans group(Axis::kDataTensor), else group(kData).
  bool sequence_parallel() const { return sp_; }
  Communicator& stream_group() const { return group(sp_ ? Axis::kDataTensor : Axis::kData); }
  CpLayout cp_layout() const { return cp_layout_; }
  // The group the routed experts' hidden features are split over
  // (MeshConfig::expert_tensor_axis): the tensor group, or its own.
  Axis expert_tensor_axis() const { return expert_tensor_axis_; }
  // mesh.overlap: collectives may be started and waited for later.
  bool overlap() const { return overlap_; }
  // Every distinct communicator, for traffic counts (a group's own too,
  // where set_group put another in its place).
  std::vector<Communicator*> communicators() const;

  // Puts `comm` (not owned; it outlives this mesh) on axis a: data lanes
  // run as a data group inside one rank (runner/data_lanes.h).
  void set_group(Axis a, Communicator* comm) { groups_[(size_t)a] = comm; }
  // mesh.shared_memory: the tensor group's shared hand-off region (not
  // owned: the runner keeps it from step to step), or null: messages.
  void set_shared_chain(SharedChain* chain) { shared_chain_ = chain; }
  SharedChain* shared_chain() const { return shared_chain_; }

  // The communicator colour of `coords`' group along axis a: the same for
  // exactly the ranks of that group (its varying coordinates set to 0).
  static int group_color(const MeshConfig& cfg, Axis a, const MeshConfig::RankCoords& coords);

 private:
  std::array<std::unique_ptr<Communicator>, kAxisCount> owned_;
  std::array<Communicator*, kAxisCount> groups_{};
  SharedChain* shared_chain_ = nullptr;
  bool sp_ = false;
  bool overlap_ = false;
  CpLayout cp_layout_ = CpLayout::kZigzag;
  Axis expert_tensor_axis_ = Axis::kTensor;
};

}  // namespace ls
