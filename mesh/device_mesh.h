// DeviceMesh: ranks arranged in an N-D grid with named axes, one process
// group per axis.
//
// Ranks are laid out row-major (the last axis varies fastest), as in
// torch.distributed's DeviceMesh: {replicate: 2, shard: 4} puts ranks 0-3 in
// replica 0 and 4-7 in replica 1, and the shard group of rank 5 is {4..7}.
// Each rank creates (once, at Create) the group of every axis it belongs to;
// groups over several axes (a sub-mesh's flattened group) and subgroups of an
// axis (blocks of consecutive ranks, e.g. ZeRO++ hpZ's intra-node group) are
// created on first use and cached, so every rank must ask for them in the
// same order.
#ifndef FSDPP_MESH_DEVICE_MESH_H_
#define FSDPP_MESH_DEVICE_MESH_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace fsdpp {

struct MeshAxis {
  std::string name;
  int size = 1;
};

class DeviceMesh {
 public:
  // Validates the shape (positive sizes, unique non-empty names, product ==
  // world_size) and creates this rank's per-axis groups through `factory`.
  // `name` prefixes the group names (distinct meshes need distinct names).
  static absl::StatusOr<std::unique_ptr<DeviceMesh>> Create(
      std::vector<MeshAxis> axes, int rank, int world_size,
      ProcessGroupFactory factory, std::string name = "mesh");

  int ndim() const { return static_cast<int>(axes_.size()); }
  const std::vector<MeshAxis>& axes() const { return axes_; }
  const std::string& name() const { return name_; }
  // Number of ranks in this mesh.
  int size() const { return static_cast<int>(ranks_.size()); }
  // This rank's index within this mesh (row-major over its coordinate).
  int rank() const { return local_rank_; }
  // Global ranks of this mesh, in row-major order.
  const std::vector<int>& ranks() const { return ranks_; }
  // This rank's coordinate, one entry per axis.
  const std::vector<int>& coordinate() const { return coordinate_; }

  // Index of axis `axis_name`; NotFound listing the axes.
  absl::StatusOr<int> AxisIndex(const std::string& axis_name) const;
  absl::StatusOr<int> AxisSize(const std::string& axis_name) const;
  absl::StatusOr<int> AxisCoordinate(const std::string& axis_name) const;

  // The process group along `axis_name` that contains this rank.
  absl::StatusOr<ProcessGroup*> Group(const std::string& axis_name) const;

  // The mesh over `axis_names` (in the given order) containing this rank:
  // the ranks sharing this rank's coordinates on the other axes. Its per-axis
  // groups are this mesh's. Cached.
  absl::StatusOr<DeviceMesh*> SubMesh(
      const std::vector<std::string>& axis_names);

  // One group over all ranks of this mesh (e.g. replicate x shard flattened),
  // created on first use and cached.
  absl::StatusOr<ProcessGroup*> FlatGroup();

  // The group of `group_size` consecutive ranks along `axis_name` that holds
  // this rank: the ranks with this rank's coordinates on the other axes whose
  // coordinate c on the axis has the same c / group_size; this rank is
  // c % group_size in it. `group_size` must divide the axis size; the whole
  // axis gives Group(axis_name). Created on first use through the mesh's
  // factory (every member must ask for it) and cached. Example: on
  // {shard: 4}, Subgroup("shard", 2) is {0, 1} on ranks 0-1 and {2, 3} on
  // ranks 2-3.
  absl::StatusOr<ProcessGroup*> Subgroup(const std::string& axis_name,
                                         int group_size);

  // A mesh of other axes over the same ranks, its groups made through this
  // mesh's factory under `name` (distinct from every other mesh's); every
  // rank calls it. Only for a mesh made by Create (FailedPrecondition for a
  // sub-mesh); Create's errors for the axes. Rank r keeps its place in
  // row-major order, so {shard: 4} reshaped to {efsdp: 2, ep: 2} gives the
  // rank at shard coordinate c the coordinates (c / 2, c % 2).
  absl::StatusOr<std::unique_ptr<DeviceMesh>> Reshape(
      std::vector<MeshAxis> axes, std::string name) const;

  // "mesh{replicate: 2, shard: 4}".
  std::string ToString() const;

 private:
  DeviceMesh() = default;

  std::string name_;
  std::vector<MeshAxis> axes_;
  std::vector<int> coordinate_;
  std::vector<int> ranks_;
  int local_rank_ = 0;
  bool whole_ = false;  // made by Create (not a sub-mesh)
  ProcessGroupFactory factory_;
  // Per-axis groups, shared with sub-meshes.
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
  std::mutex mu_;
  std::shared_ptr<ProcessGroup> flat_group_;
  // Subgroups by (axis index, group size).
  std::map<std::pair<int, int>, std::unique_ptr<ProcessGroup>> subgroups_;
  std::map<std::vector<std::string>, std::unique_ptr<DeviceMesh>> sub_meshes_;
};

}  // namespace fsdpp

#endif  // FSDPP_MESH_DEVICE_MESH_H_
