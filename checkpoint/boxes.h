// Box geometry for checkpoint chunks: intersections, and the check that a
// set of saved boxes tiles a tensor exactly.
//
// Boxes are tensor/sharding.h's Box (offset + shape in the global tensor);
// which rank holds which box is LocalBox's business, this file only compares
// boxes. CheckTiling is what makes a checkpoint trustworthy for resharding:
// every element is saved exactly once, so any target box is covered by the
// chunks that intersect it. It sweeps along the dim with the most distinct
// offsets and compares only boxes whose ranges on that dim overlap, so the
// usual layouts (row or column shards, grids) cost O(n log n).
#ifndef FSDPP_CHECKPOINT_BOXES_H_
#define FSDPP_CHECKPOINT_BOXES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tensor/sharding.h"
#include "tensor/tensor.h"

namespace fsdpp {

// Largest number of dims a checkpointed tensor may have.
inline constexpr int kMaxCheckpointDims = 16;
// Largest byte size of one checkpointed tensor (and of any byte range).
inline constexpr int64_t kMaxCheckpointBytes = int64_t{1} << 62;

// True when the box holds no element (some size is 0; a 0-dim box holds 1).
bool IsEmptyBox(const Box& box);

// The common part of two boxes of the same rank; empty when they are
// disjoint.
Box Intersect(const Box& a, const Box& b);

// "[1, 0]+[3, 5]" (offset + shape).
std::string BoxToString(const Box& box);

// OK when `shape` has at most kMaxCheckpointDims non-negative dims and the
// product of its non-zero dims times `element_size` is at most
// kMaxCheckpointBytes (empty shapes too: their strides are such products);
// otherwise InvalidArgument describing the problem.
absl::Status CheckShape(const Shape& shape, size_t element_size);

// OK when every box has shape's rank, lies inside `shape` (a CheckShape-valid
// shape), no two boxes share an element and together they cover every
// element. Empty boxes are ignored. Otherwise InvalidArgument naming the
// offending box(es), e.g. "chunk [0]+[4] overlaps chunk [2]+[4]" or "chunks
// cover 12 of 35 elements".
absl::Status CheckTiling(const Shape& shape, const std::vector<Box>& boxes);

}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_BOXES_H_
