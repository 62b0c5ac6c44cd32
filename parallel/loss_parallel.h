// Loss parallel: cross-entropy on logits sharded over the vocabulary, as
// tensor parallelism leaves them after a column-wise LM head (torch's
// loss_parallel), without ever gathering them.
//
// Each rank reduces its slice of every row to three numbers
// (CrossEntropyShardStats in tensor/ops.h: the slice's max, its sum of
// exp(x - max), the target's logit if the slice holds it); two all-reduces
// over the vocabulary's mesh axis combine them: the max (kMax), then the
// rescaled sums and target logits together (kSum, 2 N floats). The backward
// needs no communication: each rank writes its slice of dlogits from the
// combined max and sum. Memory per rank: O(N) besides the logits and
// dlogits slices themselves.
#ifndef FSDPP_PARALLEL_LOSS_PARALLEL_H_
#define FSDPP_PARALLEL_LOSS_PARALLEL_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mesh/device_mesh.h"
#include "nn/loss.h"
#include "tensor/dtensor.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace parallel {

class LossParallelCrossEntropy {
 public:
  explicit LossParallelCrossEntropy(int64_t ignore_index = -100,
                                    absl::Duration timeout = absl::Minutes(5))
      : ignore_index_(ignore_index), timeout_(timeout) {}

  // logits: a DTensor [.., V] sharded on its last dim over exactly one mesh
  // axis and replicated on the others (never Partial); targets: [..] (i32 or
  // i64, in [0, V) or ignore_index, one per row), the same on every rank of
  // that axis, on the logits' device. Returns the mean over non-ignored
  // targets, the same value on every rank (0 when all are ignored), as
  // nn::CrossEntropyLoss would on the gathered logits. Saves what Backward
  // needs. Every rank of the vocabulary axis must call it.
  absl::StatusOr<float> Forward(const DTensor& logits, const Tensor& targets);

  // dLoss/dlogits of the last Forward's mean, times `scale` (finite, > 0):
  // a DTensor placed like the logits, this rank's slice only. Releases the
  // saved state.
  absl::StatusOr<DTensor> Backward(float scale = 1.0f);

  int64_t ignore_index() const { return ignore_index_; }
  // Non-ignored targets in the last Forward.
  int64_t count() const { return count_; }

 private:
  int64_t ignore_index_;
  absl::Duration timeout_;
  // Saved by Forward.
  DTensor logits_;
  Tensor targets_, max_, sumexp_;
  int64_t vocab_offset_ = 0, count_ = 0;
  bool saved_ = false;
};

// Loss parallel as a model's nn::LossFunction: Forward takes this rank's
// vocabulary slice of the logits [.., V / tp] (what a column-wise LM head
// leaves when its output stays sharded), wraps it as a DTensor sharded on its
// last dim over the tp axis of `mesh` (V = the slice's width x tp) and runs
// LossParallelCrossEntropy; Backward returns this rank's slice of dlogits.
class LossParallel : public nn::LossFunction {
 public:
  // `mesh` must outlive the loss and have an axis `tp_axis`.
  LossParallel(DeviceMesh* mesh, std::string tp_axis = "tp",
               int64_t ignore_index = -100,
               absl::Duration timeout = absl::Minutes(5));

  absl::StatusOr<float> Forward(const Tensor& logits,
                                const Tensor& targets) override;
  absl::StatusOr<Tensor> Backward(float scale = 1.0f) override;
  int64_t ignore_index() const override { return loss_.ignore_index(); }
  int64_t count() const override { return loss_.count(); }
  std::unique_ptr<nn::LossFunction> Clone() const override;

 private:
  DeviceMesh* mesh_;
  std::string tp_axis_;
  absl::Duration timeout_;
  LossParallelCrossEntropy loss_;
};

}  // namespace parallel
}  // namespace fsdpp

#endif  // FSDPP_PARALLEL_LOSS_PARALLEL_H_
