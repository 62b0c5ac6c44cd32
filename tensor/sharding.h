// Sharding arithmetic, in one place for DTensor, FSDP, the optimizer and
// checkpoints, so they agree by construction.
//
// Chunk semantics (torch.chunk / FSDP2): n elements split k ways take
// chunk = ceil(n / k) each; piece r is [r * chunk, min(n, (r + 1) * chunk)),
// so the last pieces may be short or empty. When several mesh axes shard the
// same tensor dim, they apply in mesh-axis order: axis 0 splits the dim, axis
// 1 splits each of those pieces, and so on.
#ifndef FSDPP_TENSOR_SHARDING_H_
#define FSDPP_TENSOR_SHARDING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "tensor/placement.h"
#include "tensor/tensor.h"

namespace fsdpp {

// ceil(n / k).
int64_t ChunkSize(int64_t n, int k);

// Piece `index` of `n` split `k` ways: [begin, begin + length).
struct Range {
  int64_t begin = 0;
  int64_t length = 0;
};
Range ChunkRange(int64_t n, int k, int index);

// The box (offset and shape in the global tensor) held by the rank at
// `coordinate` of a mesh with axis sizes `mesh_shape`, for `placements`
// (Replicate and Partial hold the whole extent).
struct Box {
  Shape offset;
  Shape shape;
};
Box LocalBox(const Shape& global_shape, const std::vector<int>& mesh_shape,
             const std::vector<int>& coordinate,
             const std::vector<Placement>& placements);

// Copies the sub-box `shape` at `src_offset` of `src` to `dst_offset` of
// `dst` (same dtype; any devices). Both tensors are contiguous row-major;
// runs along the last dims are copied whole.
absl::Status CopyBox(const Tensor& src, const Shape& src_offset, Tensor* dst,
                     const Shape& dst_offset, const Shape& shape);

}  // namespace fsdpp

#endif  // FSDPP_TENSOR_SHARDING_H_
