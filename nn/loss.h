// Cross-entropy loss over logits [.., V] and integer targets, with the
// gradient of the mean over the non-ignored targets.
//
// Not a Module: it has two inputs and no parameters. The per-row losses come
// from the CrossEntropy op (f32); the mean divides their f64-accumulated sum
// by the number of targets that are not `ignore_index`, counted on the host
// from the targets (a row's loss can be exactly 0, so the losses cannot tell).
// With no counted target the loss is 0 and the gradient all zeros (no NaN).
#ifndef FSDPP_NN_LOSS_H_
#define FSDPP_NN_LOSS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// mean over i with targets[i] != ignore_index of -log softmax(logits[i])[t].
class CrossEntropyLoss {
 public:
  explicit CrossEntropyLoss(int64_t ignore_index = -100)
      : ignore_index_(ignore_index) {}

  // logits [.., V] (f32/bf16/f16) with one row per element of targets
  // (i32/i64, in [0, V) or ignore_index). Saves logits and targets for
  // Backward. On meta tensors it only validates shapes and returns 0.
  absl::StatusOr<float> Forward(const Tensor& logits, const Tensor& targets);
  // dLoss/dlogits of the last Forward's mean, times `scale` (logits' shape
  // and dtype; the scale is applied in f32 before the cast, so a loss scale
  // for fp16 or a 1/micro-batches factor costs no extra pass); then releases
  // the saved tensors (a second Backward needs another Forward).
  // InvalidArgument unless scale is finite and > 0.
  absl::StatusOr<Tensor> Backward(float scale = 1.0f);

  // The target value that is left out of the mean.
  int64_t ignore_index() const { return ignore_index_; }
  // Non-ignored targets in the last Forward.
  int64_t count() const { return count_; }

 private:
  int64_t ignore_index_;
  int64_t count_ = 0;
  Tensor saved_logits_;
  Tensor saved_targets_;
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_LOSS_H_
