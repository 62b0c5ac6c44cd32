// Sharding arithmetic and box copies; see sharding.h.
#include "tensor/sharding.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/memcpy.h"
#include "core/status.h"

namespace fsdpp {

int64_t ChunkSize(int64_t n, int k) { return (n + k - 1) / k; }

Range ChunkRange(int64_t n, int k, int index) {
  const int64_t chunk = ChunkSize(n, k);
  const int64_t begin = std::min(n, index * chunk);
  const int64_t end = std::min(n, (index + 1) * chunk);
  return Range{begin, end - begin};
}

Box LocalBox(const Shape& global_shape, const std::vector<int>& mesh_shape,
             const std::vector<int>& coordinate,
             const std::vector<Placement>& placements) {
  Box box{Shape(global_shape.size(), 0), global_shape};
  for (size_t axis = 0; axis < placements.size(); ++axis) {
    if (!placements[axis].is_shard()) continue;
    const int d = placements[axis].dim();
    const Range r =
        ChunkRange(box.shape[d], mesh_shape[axis], coordinate[axis]);
    box.offset[d] += r.begin;
    box.shape[d] = r.length;
  }
  return box;
}

absl::Status CopyBox(const Tensor& src, const Shape& src_offset, Tensor* dst,
                     const Shape& dst_offset, const Shape& shape) {
  const int nd = src.ndim();
  if (dst->ndim() != nd || static_cast<int>(src_offset.size()) != nd ||
      static_cast<int>(dst_offset.size()) != nd ||
      static_cast<int>(shape.size()) != nd || src.dtype() != dst->dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CopyBox: rank or dtype mismatch (src ", src.ToString(), ", dst ",
        dst->ToString(), ", box ", ShapeToString(shape), ")"));
  }
  for (int d = 0; d < nd; ++d) {
    if (shape[d] < 0 || src_offset[d] < 0 || dst_offset[d] < 0 ||
        src_offset[d] + shape[d] > src.dim(d) ||
        dst_offset[d] + shape[d] > dst->dim(d)) {
      return absl::OutOfRangeError(
          absl::StrCat("CopyBox: box ", ShapeToString(shape), " at ",
                       ShapeToString(src_offset), " of ", src.ToString(),
                       " -> at ", ShapeToString(dst_offset), " of ",
                       dst->ToString(), " is out of range"));
    }
  }
  if (NumElements(shape) == 0 || src.is_meta() || dst->is_meta()) {
    return absl::OkStatus();
  }
  // Merge trailing dims that are copied whole into one contiguous run.
  int run_dim = nd;  // Dims [run_dim, nd) form one contiguous run.
  int64_t run = 1;
  while (run_dim > 0) {
    const int d = run_dim - 1;
    run *= shape[d];
    --run_dim;
    if (shape[d] != src.dim(d) || shape[d] != dst->dim(d)) break;
  }
  const size_t esize = DTypeSize(src.dtype());
  // Strides in elements.
  std::vector<int64_t> src_stride(nd, 1), dst_stride(nd, 1);
  for (int d = nd - 2; d >= 0; --d) {
    src_stride[d] = src_stride[d + 1] * src.dim(d + 1);
    dst_stride[d] = dst_stride[d + 1] * dst->dim(d + 1);
  }
  // Iterate over the outer index space [0, run_dim).
  std::vector<int64_t> idx(std::max(run_dim, 0), 0);
  const char* s = static_cast<const char*>(src.raw_data());
  char* t = static_cast<char*>(dst->raw_data());
  for (;;) {
    int64_t so = 0, doff = 0;
    for (int d = 0; d < nd; ++d) {
      const int64_t i = d < run_dim ? idx[d] : 0;
      so += (src_offset[d] + i) * src_stride[d];
      doff += (dst_offset[d] + i) * dst_stride[d];
    }
    FSDPP_RETURN_IF_ERROR(CopyBytes(t + doff * esize, dst->device(),
                                    s + so * esize, src.device(), run * esize));
    int d = run_dim - 1;
    while (d >= 0 && ++idx[d] == shape[d]) idx[d--] = 0;
    if (d < 0) break;
  }
  return absl::OkStatus();
}

}  // namespace fsdpp
