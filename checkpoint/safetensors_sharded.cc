// Sharded safetensors import; see safetensors_sharded.h.
#include "checkpoint/safetensors_sharded.h"

#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/boxes.h"
#include "core/memcpy.h"
#include "core/status.h"
#include "formats/safetensors/safetensors.h"
#include "tensor/sharding.h"

namespace fsdpp {
namespace {

std::vector<int> MeshShape(const DeviceMesh& mesh) {
  std::vector<int> shape;
  for (const MeshAxis& axis : mesh.axes()) shape.push_back(axis.size);
  return shape;
}

std::string Names(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  for (size_t i = 0; i < names.size() && i < 20; ++i) {
    quoted.push_back(absl::StrCat("'", names[i], "'"));
  }
  if (names.size() > 20) {
    quoted.push_back(absl::StrCat("... (", names.size(), " in all)"));
  }
  return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
}

// What the state wants from one tensor of the file.
struct Target {
  std::string key;
  std::string name;
  StateDict::Item* item;
  DType dtype;
  Shape shape;
};

// Copies `box` of tensor `name` into `dst` (shape box.shape).
absl::Status CopyOut(const SafetensorsFile& file, const std::string& name,
                     const SafetensorsTensorInfo& info, const Box& box,
                     Tensor* dst, uint64_t* bytes_read) {
  if (IsEmptyBox(box)) return absl::OkStatus();
  const size_t n = box.shape.size();
  FSDPP_ASSIGN_OR_RETURN(absl::Span<const char> bytes, file.Bytes(name));
  int64_t row_elements = 1;
  bool whole_rows = true;
  for (size_t d = 1; d < n; ++d) {
    row_elements *= info.shape[d];
    whole_rows = whole_rows && box.shape[d] == info.shape[d];
  }
  const uint64_t row_bytes =
      static_cast<uint64_t>(row_elements) * info.element_size;
  if (whole_rows) {
    const uint64_t begin = n == 0 ? 0 : box.offset[0] * row_bytes;
    const uint64_t length = dst->nbytes();
    *bytes_read += length;
    return CopyBytes(dst->raw_data(), dst->device(), bytes.data() + begin,
                     Device::Cpu(), length);
  }
  // n >= 2 here: only the rows of the box are copied out of the mapping.
  FSDPP_ASSIGN_OR_RETURN(
      Tensor rows,
      file.LoadRows(name, box.offset[0], box.offset[0] + box.shape[0]));
  *bytes_read += rows.nbytes();
  Shape src_offset = box.offset;
  src_offset[0] = 0;
  return CopyBox(rows, src_offset, dst, Shape(n, 0), box.shape);
}

}  // namespace

absl::StatusOr<LoadResult> LoadSafetensorsSharded(
    const std::string& path, StateDict* state,
    const SafetensorsLoadOptions& options) {
  const absl::Time start = absl::Now();
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                         SafetensorsFile::Open(path));
  LoadResult result;
  result.path = path;
  std::vector<Target> targets;
  std::set<std::string> used;
  for (const auto& [key, item] : state->items()) {
    const std::string name =
        options.name_for_key ? options.name_for_key(key) : key;
    if (!file->Contains(name)) {
      result.missing_keys.push_back(key);
      continue;
    }
    used.insert(name);
    Target target{key, name, state->FindMutable(key), DType::kU8, {}};
    switch (item.kind) {
      case StateDict::Kind::kDTensor:
        target.dtype = item.dtensor.dtype();
        target.shape = item.dtensor.shape();
        for (const Placement& p : item.dtensor.placements()) {
          if (p.is_partial()) {
            return absl::InvalidArgumentError(absl::StrCat(
                path, ": cannot load '", name, "' into a DTensor with ",
                PlacementsToString(item.dtensor.placements())));
          }
        }
        break;
      case StateDict::Kind::kTensor:
        target.dtype = item.tensor.dtype();
        target.shape = item.tensor.shape();
        break;
      case StateDict::Kind::kBytes:
        target.dtype = DType::kU8;
        break;
    }
    FSDPP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo info, file->Info(name));
    if (!info.dtype.has_value()) {
      return absl::UnimplementedError(
          absl::StrCat(path, ": tensor '", name, "' has dtype ",
                       info.dtype_name, ", which fsdpp cannot hold"));
    }
    if (item.kind == StateDict::Kind::kBytes) {
      if (*info.dtype != DType::kU8 || info.shape.size() != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", name, "' is ", info.dtype_name,
                         ShapeToString(info.shape), "; the byte value '", key,
                         "' needs a 1-D U8 tensor"));
      }
      target.shape = info.shape;
    }
    if (*info.dtype != target.dtype || info.shape != target.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", name, "' (key '", key,
                       "'): ", info.shape != target.shape ? "shape" : "dtype",
                       " mismatch: the file has ", DTypeName(*info.dtype),
                       ShapeToString(info.shape), ", the state has ",
                       DTypeName(target.dtype), ShapeToString(target.shape)));
    }
    targets.push_back(std::move(target));
  }
  for (const std::string& name : file->names()) {
    if (used.count(name) == 0) result.unexpected_keys.push_back(name);
  }
  if (options.strict && !result.missing_keys.empty()) {
    return absl::NotFoundError(absl::StrCat(
        path, ": no tensors for the state keys ", Names(result.missing_keys)));
  }
  if (options.strict && !result.unexpected_keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": tensors the state does not hold: ", Names(result.unexpected_keys)));
  }
  for (const Target& target : targets) {
    FSDPP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo info,
                           file->Info(target.name));
    StateDict::Item& item = *target.item;
    switch (item.kind) {
      case StateDict::Kind::kDTensor: {
        const DTensor& t = item.dtensor;
        const Box box = LocalBox(t.shape(), MeshShape(*t.mesh()),
                                 t.mesh()->coordinate(), t.placements());
        FSDPP_RETURN_IF_ERROR(CopyOut(*file, target.name, info, box,
                                      item.dtensor.mutable_local(),
                                      &result.bytes_read));
        break;
      }
      case StateDict::Kind::kTensor:
        FSDPP_RETURN_IF_ERROR(
            CopyOut(*file, target.name, info,
                    Box{Shape(info.shape.size(), 0), info.shape}, &item.tensor,
                    &result.bytes_read));
        break;
      case StateDict::Kind::kBytes: {
        FSDPP_ASSIGN_OR_RETURN(absl::Span<const char> bytes,
                               file->Bytes(target.name));
        item.bytes.assign(bytes.data(), bytes.size());
        result.bytes_read += bytes.size();
        break;
      }
    }
  }
  result.time = absl::Now() - start;
  return result;
}

}  // namespace fsdpp
