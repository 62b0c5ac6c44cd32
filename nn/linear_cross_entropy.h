// An LM head whose matmul can be fused with the mean cross-entropy of its
// output, a chunk of rows at a time (what Liger's and torchtune's fused
// linear cross-entropy do), so that the [tokens, V] logits and their
// gradient are never whole in memory.
//
// Armed with targets (ArmLoss), one Forward(x) computes for each chunk of
// `chunk_rows` rows of x: logits_c = x_c W^T (a [chunk, V] temporary), the
// rows' losses, dlogits_c = (softmax - onehot) / count written over logits_c,
// dx_c = dlogits_c W and dW += dlogits_c^T x_c. It returns the losses' sum
// (f32, one element, on x's device) and keeps dx ([.., in], x's dtype) and dW
// ([V, in], x's dtype) for Backward, which scales them by the loss scale
// (set_backward_scale), adds dW into the weight's gradient and returns dx.
// Peak memory of the head: one chunk's logits plus dW and dx instead of the
// whole [tokens, V] logits; time: the same matmuls plus one pass over dW.
// dW accumulates chunk by chunk in x's dtype (for bf16, one rounding per
// chunk, as Liger's).
//
// Unarmed, it is a plain Linear. The fused form needs the whole weight on
// this process (no tensor-parallel piece, no layout transforms) and no bias.
#ifndef FSDPP_NN_LINEAR_CROSS_ENTROPY_H_
#define FSDPP_NN_LINEAR_CROSS_ENTROPY_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "nn/linear.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

class LinearCrossEntropy : public Linear {
 public:
  using Linear::Linear;

  // Logits of one automatic chunk take at most this many bytes.
  static constexpr int64_t kAutoChunkBytes = int64_t{128} << 20;
  // Rows of an automatic chunk for a vocabulary of `vocab` logits of `dtype`:
  // the most whose logits fit kAutoChunkBytes, a multiple of 16, at least 16.
  static int64_t AutoChunkRows(int64_t vocab, DType dtype);
  // Whether the fused form can run on this layer now (no bias, the whole
  // weight, no transforms).
  bool CanFuseLoss() const;

  // ArmLoss's chunk_rows for the automatic choice.
  static constexpr int64_t kAutoChunk = -1;
  // Arms the next Forward: it computes the mean cross-entropy of its logits
  // against `targets` (i32/i64, one per row of x, in [0, V) or
  // ignore_index), `chunk_rows` rows at a time, and returns the sum of the
  // rows' losses instead of the logits. With kAutoChunk the chunk is
  // at most AutoChunkRows(V, x's dtype), the rows split into equal chunks,
  // and the fused form runs only where it saves memory (rows > chunk +
  // in_features, i.e. the logits outweigh one chunk's plus dW); otherwise
  // that Forward returns the logits as usual (last_forward_fused() tells
  // which). FailedPrecondition unless
  // CanFuseLoss(); InvalidArgument for a bad chunk or targets. The arming is
  // used up by that Forward (a failed one too).
  absl::Status ArmLoss(const Tensor& targets, int64_t ignore_index,
                       int64_t chunk_rows);
  // Drops an arming no Forward used (after a failed forward upstream, so
  // that a later plain Forward gives logits).
  void Disarm() { armed_targets_ = Tensor(); }
  // Whether the last Forward ran the fused form.
  bool last_forward_fused() const { return last_fused_; }
  // Non-ignored targets in the last fused Forward (the mean's denominator).
  int64_t count() const { return count_; }
  // Whether a fused Forward awaits its Backward.
  bool fused_pending() const { return saved_dx_.defined(); }
  // The factor the pending fused Backward multiplies the mean's gradient by
  // (finite and > 0; e.g. 1 / micro-batches, times an fp16 loss scale).
  void set_backward_scale(float scale) { backward_scale_ = scale; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  // After a fused Forward, dy is ignored (it may be undefined).
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override;

 private:
  absl::StatusOr<Tensor> FusedForward(const Tensor& x, const Tensor& targets,
                                      int64_t chunk_rows);
  absl::StatusOr<Tensor> FusedBackward();

  // Set by ArmLoss, cleared by the Forward that uses it.
  Tensor armed_targets_;
  int64_t ignore_index_ = -100;
  int64_t chunk_rows_ = 0;

  bool last_fused_ = false;
  int64_t count_ = 0;
  float backward_scale_ = 1.0f;
  Tensor saved_dx_;  // d(mean loss)/dx, x's shape
  Tensor saved_dw_;  // d(mean loss)/dW (undefined: no weight gradient)
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_LINEAR_CROSS_ENTROPY_H_
