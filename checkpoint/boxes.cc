// Box intersections and tiling checks; see boxes.h.
#include "checkpoint/boxes.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fsdpp {

bool IsEmptyBox(const Box& box) {
  for (int64_t s : box.shape) {
    if (s <= 0) return true;
  }
  return false;
}

Box Intersect(const Box& a, const Box& b) {
  const size_t n = std::min(a.offset.size(), b.offset.size());
  Box r{Shape(n, 0), Shape(n, 0)};
  for (size_t d = 0; d < n; ++d) {
    const int64_t lo = std::max(a.offset[d], b.offset[d]);
    const int64_t hi =
        std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    r.offset[d] = lo;
    r.shape[d] = std::max<int64_t>(0, hi - lo);
  }
  return r;
}

std::string BoxToString(const Box& box) {
  return absl::StrCat(ShapeToString(box.offset), "+", ShapeToString(box.shape));
}

absl::Status CheckShape(const Shape& shape, size_t element_size) {
  if (shape.size() > static_cast<size_t>(kMaxCheckpointDims)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape has ", shape.size(), " dims (at most ",
                     kMaxCheckpointDims, " are supported)"));
  }
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeToString(shape), " has a negative dim"));
    }
  }
  // The non-zero dims are bounded even when a zero dim makes the shape
  // empty: element counts of the shape's prefixes (and of boxes inside it)
  // are products of them, and must not overflow.
  const int64_t limit = kMaxCheckpointBytes /
                        static_cast<int64_t>(std::max<size_t>(1, element_size));
  int64_t volume = 1;
  for (int64_t d : shape) {
    if (d == 0) continue;
    if (volume > limit / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeToString(shape),
                       " is too large (more than 2^62 bytes)"));
    }
    volume *= d;
  }
  return absl::OkStatus();
}

absl::Status CheckTiling(const Shape& shape, const std::vector<Box>& boxes) {
  const size_t n = shape.size();
  const uint64_t total = static_cast<uint64_t>(NumElements(shape));
  std::vector<size_t> live;
  uint64_t covered = 0;
  for (const Box& box : boxes) {
    if (box.offset.size() != n || box.shape.size() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", BoxToString(box), " has ", box.offset.size(),
                       " offsets and ", box.shape.size(),
                       " sizes for a tensor of shape ", ShapeToString(shape)));
    }
    for (size_t d = 0; d < n; ++d) {
      if (box.offset[d] < 0 || box.shape[d] < 0 || box.offset[d] > shape[d] ||
          box.shape[d] > shape[d] - box.offset[d]) {
        return absl::InvalidArgumentError(
            absl::StrCat("chunk ", BoxToString(box), " lies outside the shape ",
                         ShapeToString(shape)));
      }
    }
    if (IsEmptyBox(box)) continue;
    live.push_back(&box - boxes.data());
    // Volumes are at most `total` (<= 2^62), so the sum cannot wrap before
    // it exceeds `total`.
    if (covered <= total)
      covered += static_cast<uint64_t>(NumElements(box.shape));
  }
  auto overlap_error = [&](size_t a, size_t b) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", BoxToString(boxes[a]), " overlaps chunk ",
                     BoxToString(boxes[b])));
  };
  if (n == 0) {
    if (live.size() > 1) return overlap_error(live[0], live[1]);
  } else if (live.size() > 1) {
    // Sweep along the dim with the most distinct offsets.
    size_t sweep = 0;
    size_t best = 0;
    for (size_t d = 0; d < n; ++d) {
      std::vector<int64_t> offsets;
      offsets.reserve(live.size());
      for (size_t i : live) offsets.push_back(boxes[i].offset[d]);
      std::sort(offsets.begin(), offsets.end());
      const size_t distinct =
          std::unique(offsets.begin(), offsets.end()) - offsets.begin();
      if (distinct > best) {
        best = distinct;
        sweep = d;
      }
    }
    std::sort(live.begin(), live.end(), [&](size_t a, size_t b) {
      return boxes[a].offset[sweep] < boxes[b].offset[sweep];
    });
    std::vector<size_t> active;
    for (size_t i : live) {
      const int64_t begin = boxes[i].offset[sweep];
      for (size_t k = 0; k < active.size();) {
        const Box& a = boxes[active[k]];
        if (a.offset[sweep] + a.shape[sweep] <= begin) {
          active[k] = active.back();
          active.pop_back();
        } else {
          ++k;
        }
      }
      for (size_t j : active) {
        if (!IsEmptyBox(Intersect(boxes[i], boxes[j]))) {
          return overlap_error(std::min(i, j), std::max(i, j));
        }
      }
      active.push_back(i);
    }
  }
  if (covered != total) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunks cover ", covered, " of the ", total,
                     " elements of shape ", ShapeToString(shape)));
  }
  return absl::OkStatus();
}

}  // namespace fsdpp
