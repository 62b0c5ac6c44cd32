// DeviceMesh; see device_mesh.h.
#include "mesh/device_mesh.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace fsdpp {
namespace {

std::string AxesString(const std::vector<MeshAxis>& axes) {
  std::vector<std::string> parts;
  for (const MeshAxis& a : axes)
    parts.push_back(absl::StrCat(a.name, ": ", a.size));
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

// Row-major rank of `coord` in a grid of `sizes`.
int Linear(const std::vector<int>& coord, const std::vector<int>& sizes) {
  int r = 0;
  for (size_t i = 0; i < coord.size(); ++i) r = r * sizes[i] + coord[i];
  return r;
}

int64_t NumElementsOf(const std::vector<int>& sizes) {
  int64_t n = 1;
  for (int s : sizes) n *= s;
  return n;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMesh>> DeviceMesh::Create(
    std::vector<MeshAxis> axes, int rank, int world_size,
    ProcessGroupFactory factory, std::string name) {
  if (axes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh '", name, "' needs at least one axis"));
  }
  int64_t product = 1;
  std::set<std::string> names;
  for (const MeshAxis& a : axes) {
    if (a.name.empty() || !names.insert(a.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh '", name, "' ", AxesString(axes),
                       ": axis names must be non-empty and unique"));
    }
    if (a.size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh '", name, "' ", AxesString(axes), ": axis '",
                       a.name, "' has size ", a.size));
    }
    product *= a.size;
  }
  if (product != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh '", name, "' ", AxesString(axes), " has ", product,
                     " ranks but the world size is ", world_size));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mesh '", name, "': rank ", rank, " is not in [0, ", world_size, ")"));
  }
  std::unique_ptr<DeviceMesh> mesh(new DeviceMesh);
  mesh->name_ = std::move(name);
  mesh->axes_ = std::move(axes);
  mesh->factory_ = std::move(factory);
  mesh->local_rank_ = rank;
  mesh->whole_ = true;
  for (int r = 0; r < world_size; ++r) mesh->ranks_.push_back(r);
  std::vector<int> sizes;
  for (const MeshAxis& a : mesh->axes_) sizes.push_back(a.size);
  mesh->coordinate_.resize(sizes.size());
  for (int i = static_cast<int>(sizes.size()) - 1, rest = rank; i >= 0; --i) {
    mesh->coordinate_[i] = rest % sizes[i];
    rest /= sizes[i];
  }
  // One group per axis: the ranks that differ from this one only on it.
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<std::string> fixed;
    for (size_t j = 0; j < sizes.size(); ++j) {
      if (j != i) {
        fixed.push_back(
            absl::StrCat(mesh->axes_[j].name, "=", mesh->coordinate_[j]));
      }
    }
    const std::string group_name =
        absl::StrCat(mesh->name_, "/", mesh->axes_[i].name,
                     fixed.empty() ? "" : "@", absl::StrJoin(fixed, ","));
    FSDPP_ASSIGN_OR_RETURN(
        std::unique_ptr<ProcessGroup> group,
        mesh->factory_(group_name, mesh->coordinate_[i], sizes[i]));
    mesh->groups_.push_back(std::move(group));
  }
  return mesh;
}

absl::StatusOr<std::unique_ptr<DeviceMesh>> DeviceMesh::Reshape(
    std::vector<MeshAxis> axes, std::string name) const {
  if (!whole_) {
    return absl::FailedPreconditionError(absl::StrCat(
        ToString(), ": only a whole mesh (DeviceMesh::Create's) reshapes"));
  }
  return Create(std::move(axes), local_rank_, size(), factory_,
                std::move(name));
}

absl::StatusOr<int> DeviceMesh::AxisIndex(const std::string& axis_name) const {
  for (int i = 0; i < ndim(); ++i) {
    if (axes_[i].name == axis_name) return i;
  }
  return absl::NotFoundError(absl::StrCat("mesh '", name_, "' ",
                                          AxesString(axes_), " has no axis '",
                                          axis_name, "'"));
}

absl::StatusOr<int> DeviceMesh::AxisSize(const std::string& axis_name) const {
  FSDPP_ASSIGN_OR_RETURN(int i, AxisIndex(axis_name));
  return axes_[i].size;
}

absl::StatusOr<int> DeviceMesh::AxisCoordinate(
    const std::string& axis_name) const {
  FSDPP_ASSIGN_OR_RETURN(int i, AxisIndex(axis_name));
  return coordinate_[i];
}

absl::StatusOr<ProcessGroup*> DeviceMesh::Group(
    const std::string& axis_name) const {
  FSDPP_ASSIGN_OR_RETURN(int i, AxisIndex(axis_name));
  return groups_[i].get();
}

absl::StatusOr<DeviceMesh*> DeviceMesh::SubMesh(
    const std::vector<std::string>& axis_names) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sub_meshes_.find(axis_names);
  if (it != sub_meshes_.end()) return it->second.get();
  if (axis_names.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh '", name_, "': empty sub-mesh"));
  }
  std::vector<int> picked;
  std::set<int> seen;
  for (const std::string& n : axis_names) {
    FSDPP_ASSIGN_OR_RETURN(int i, AxisIndex(n));
    if (!seen.insert(i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh '", name_, "': axis '", n, "' named twice"));
    }
    picked.push_back(i);
  }
  std::unique_ptr<DeviceMesh> sub(new DeviceMesh);
  std::vector<std::string> fixed;
  for (int j = 0; j < ndim(); ++j) {
    if (!seen.count(j))
      fixed.push_back(absl::StrCat(axes_[j].name, "=", coordinate_[j]));
  }
  sub->name_ =
      absl::StrCat(name_, "/", absl::StrJoin(axis_names, "+"),
                   fixed.empty() ? "" : "@", absl::StrJoin(fixed, ","));
  sub->factory_ = factory_;
  std::vector<int> sub_sizes;
  for (int i : picked) {
    sub->axes_.push_back(axes_[i]);
    sub->coordinate_.push_back(coordinate_[i]);
    sub->groups_.push_back(groups_[i]);
    sub_sizes.push_back(axes_[i].size);
  }
  sub->local_rank_ = Linear(sub->coordinate_, sub_sizes);
  // Global ranks of the sub-mesh: vary the picked axes, fix the others.
  std::vector<int> sizes;
  for (const MeshAxis& a : axes_) sizes.push_back(a.size);
  const int sub_count = static_cast<int>(NumElementsOf(sub_sizes));
  for (int s = 0; s < sub_count; ++s) {
    std::vector<int> coord = coordinate_;
    for (int k = static_cast<int>(picked.size()) - 1, rest = s; k >= 0; --k) {
      coord[picked[k]] = rest % sub_sizes[k];
      rest /= sub_sizes[k];
    }
    sub->ranks_.push_back(ranks_[Linear(coord, sizes)]);
  }
  DeviceMesh* out = sub.get();
  sub_meshes_.emplace(axis_names, std::move(sub));
  return out;
}

absl::StatusOr<ProcessGroup*> DeviceMesh::FlatGroup() {
  std::lock_guard<std::mutex> lock(mu_);
  if (flat_group_ == nullptr) {
    if (ndim() == 1) {
      flat_group_ = groups_[0];
    } else {
      FSDPP_ASSIGN_OR_RETURN(
          std::unique_ptr<ProcessGroup> group,
          factory_(absl::StrCat(name_, "/flat"), local_rank_, size()));
      flat_group_ = std::move(group);
    }
  }
  return flat_group_.get();
}

absl::StatusOr<ProcessGroup*> DeviceMesh::Subgroup(const std::string& axis_name,
                                                   int group_size) {
  FSDPP_ASSIGN_OR_RETURN(int axis, AxisIndex(axis_name));
  const int axis_size = axes_[axis].size;
  if (group_size < 1 || axis_size % group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mesh '", name_, "' ", AxesString(axes_), ": a subgroup of ",
        group_size, " ranks does not divide axis '", axis_name, "' of size ",
        axis_size));
  }
  if (group_size == axis_size) return groups_[axis].get();
  std::lock_guard<std::mutex> lock(mu_);
  auto key = std::make_pair(axis, group_size);
  auto it = subgroups_.find(key);
  if (it != subgroups_.end()) return it->second.get();
  // "mesh/shard[2..3]@replicate=1": the axis coordinates it spans, then the
  // other axes' fixed coordinates, so distinct groups have distinct names.
  const int first = coordinate_[axis] / group_size * group_size;
  std::vector<std::string> fixed;
  for (int j = 0; j < ndim(); ++j) {
    if (j != axis)
      fixed.push_back(absl::StrCat(axes_[j].name, "=", coordinate_[j]));
  }
  const std::string group_name = absl::StrCat(
      name_, "/", axis_name, "[", first, "..", first + group_size - 1, "]",
      fixed.empty() ? "" : "@", absl::StrJoin(fixed, ","));
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<ProcessGroup> group,
      factory_(group_name, coordinate_[axis] % group_size, group_size));
  ProcessGroup* out = group.get();
  subgroups_.emplace(key, std::move(group));
  return out;
}

std::string DeviceMesh::ToString() const {
  return absl::StrCat(name_, AxesString(axes_));
}

}  // namespace fsdpp
