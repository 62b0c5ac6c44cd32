// DTensor: a tensor distributed over a DeviceMesh — this rank's local tensor,
// the mesh, one Placement per mesh axis, and the global shape.
//
// FSDP's sharded parameters, gradients and optimizer state and the
// checkpoint's resharding are all DTensors; the arithmetic of who holds what
// lives in tensor/sharding.h. Redistribute moves between any two placement
// lists, planned axis by axis: axes that change are first brought to
// Replicate from the innermost axis out (or converted directly when that is
// cheaper: Partial -> Shard by reduce-scatter, Shard(a) -> Shard(b) by
// all-to-all), then the targets are applied from the outermost axis in, so
// nested sharding of one dim by several axes stays in mesh-axis order.
// Uneven shards are padded at the tail for the collectives.
//
// Every collective is issued from the calling thread in program order (so
// ranks always agree on the order); packing and unpacking run on a helper
// stream chained to the collectives by events, which is what makes the
// asynchronous form possible.
#ifndef FSDPP_TENSOR_DTENSOR_H_
#define FSDPP_TENSOR_DTENSOR_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/stream.h"
#include "mesh/device_mesh.h"
#include "tensor/placement.h"
#include "tensor/sharding.h"
#include "tensor/tensor.h"

namespace fsdpp {

class PendingDTensor;

class DTensor {
 public:
  DTensor() = default;

  // Wraps this rank's `local` piece. `global_shape` is required when shards
  // may be uneven; when empty it is inferred assuming every Shard axis splits
  // evenly. Checks that `local` has the shape the placements give this rank.
  static absl::StatusOr<DTensor> FromLocal(Tensor local, DeviceMesh* mesh,
                                           std::vector<Placement> placements,
                                           Shape global_shape = {});

  // Where the full tensor comes from in Distribute.
  enum class Source {
    kEveryRank,  // Every rank passes the same full tensor: split locally.
    kBroadcast,  // Only `source_rank` (a mesh rank) has it: broadcast, split.
  };
  // Distributes `full` with `placements` (Partial is not a valid target here:
  // distribute as Replicate and Redistribute). With kBroadcast, `full` on the
  // other ranks only supplies shape and dtype (its data is overwritten).
  static absl::StatusOr<DTensor> Distribute(const Tensor& full,
                                            DeviceMesh* mesh,
                                            std::vector<Placement> placements,
                                            Source source = Source::kEveryRank,
                                            int source_rank = 0);

  const Tensor& local() const { return local_; }
  Tensor* mutable_local() { return &local_; }
  DeviceMesh* mesh() const { return mesh_; }
  const std::vector<Placement>& placements() const { return placements_; }
  const Shape& shape() const { return global_shape_; }
  DType dtype() const { return local_.dtype(); }
  // Where this rank's piece sits in the global tensor.
  Box local_box() const;
  // "DTensor(f32[10, 3] [S(0), R] local f32[5, 3] cpu)".
  std::string ToString() const;

  // A new DTensor with `placements`; this one is unchanged.
  absl::StatusOr<DTensor> Redistribute(
      const std::vector<Placement>& placements,
      absl::Duration timeout = absl::Minutes(30)) const;
  // The same, returning at once; the collectives are already issued.
  absl::StatusOr<std::shared_ptr<PendingDTensor>> RedistributeAsync(
      const std::vector<Placement>& placements) const;

  // The whole tensor on every rank (all-Replicate, then the local tensor).
  absl::StatusOr<Tensor> FullTensor(
      absl::Duration timeout = absl::Minutes(30)) const;

 private:
  friend class DTensorPlanner;
  DTensor(Tensor local, DeviceMesh* mesh, std::vector<Placement> placements,
          Shape global_shape)
      : local_(std::move(local)),
        mesh_(mesh),
        placements_(std::move(placements)),
        global_shape_(std::move(global_shape)) {}

  Tensor local_;
  DeviceMesh* mesh_ = nullptr;
  std::vector<Placement> placements_;
  Shape global_shape_;
};

// A Redistribute in flight.
class PendingDTensor {
 public:
  PendingDTensor(DTensor result, std::shared_ptr<Event> done,
                 std::shared_ptr<CpuStream> stream)
      : result_(std::move(result)),
        done_(std::move(done)),
        stream_(std::move(stream)) {}
  bool IsCompleted() const { return done_->IsCompleted(); }
  // Blocks until the data is in place; the result or the first error.
  absl::StatusOr<DTensor> Wait(
      absl::Duration timeout = absl::Minutes(30)) const;

 private:
  DTensor result_;
  std::shared_ptr<Event> done_;
  std::shared_ptr<CpuStream> stream_;  // Keeps the worker alive.
};

// ------------------------------------------------------------------- ops
// The few DTensor ops the stack needs. Operands must have the same global
// shape, mesh and placements; anything else fails naming the op and both
// placement lists.

// out = a + b (Partial(sum) + Partial(sum) is allowed).
absl::Status Add(const DTensor& a, const DTensor& b, DTensor* out);
// out = a * b (no Partial operands).
absl::Status Mul(const DTensor& a, const DTensor& b, DTensor* out);
// out = alpha * x (Partial(sum/avg) scale fine; Partial(max) needs alpha >= 0).
absl::Status Scale(const DTensor& x, float alpha, DTensor* out);
// dst = src (same placements; converts dtype).
absl::Status Copy(const DTensor& src, DTensor* dst);
// Sum of squares of all elements of the global tensor, the same on every
// rank: local sum, then an all-reduce over the Shard axes only (Replicate
// axes are not double counted; Partial axes are reduced first).
absl::StatusOr<double> SumOfSquares(const DTensor& x);
// sqrt(SumOfSquares).
absl::StatusOr<double> Norm(const DTensor& x);

}  // namespace fsdpp

#endif  // FSDPP_TENSOR_DTENSOR_H_
