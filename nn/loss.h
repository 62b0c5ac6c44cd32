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
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/device.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// Targets (i32/i64, not meta) that are not `ignore_index`; read from the host
// copy unless they were checked on the host (Tensor::ids_checked_below) and
// ignore_index is negative, in which case every target counts.
absl::StatusOr<int64_t> CountTargets(const Tensor& targets,
                                     int64_t ignore_index);

// InvalidArgument, naming `who`, unless `sum` (ForwardAccumulate's running
// loss) is an f32 tensor of one element on `device`.
absl::Status CheckLossSum(const Tensor* sum, Device device,
                          absl::string_view who);
// A mean's divisor: `normalizer` when > 0, else `count`.
inline double MeanDivisor(int64_t count, double normalizer) {
  return normalizer > 0 ? normalizer : static_cast<double>(count);
}
// The mean `total` / divisor of a loss total (f32, one element), read back,
// with divisor = `normalizer` when > 0, else `count`; 0 when nothing was
// counted (or on meta tensors, count 0 there).
absl::StatusOr<float> MeanOfTotal(const Tensor& total, int64_t count,
                                  double normalizer = 0);
// *sum += weight * total / divisor on the device (the divisor as in
// MeanOfTotal); nothing when count is 0.
absl::Status AccumulateMean(const Tensor& total, int64_t count, double weight,
                            Tensor* sum, double normalizer = 0);

// A loss on a model's output: the mean of a per-target loss over the
// targets that are not ignore_index, and its gradient. A model holds one and
// can be given another (tensor parallelism's loss parallel computes it on
// vocabulary-sharded logits).
class LossFunction {
 public:
  virtual ~LossFunction() = default;
  // The mean loss of `logits` against `targets`; saves what Backward needs.
  virtual absl::StatusOr<float> Forward(const Tensor& logits,
                                        const Tensor& targets) = 0;
  // Forward with the mean loss left on the device: `weight` times it is
  // added to `*sum` (f32, one element, on the logits' device) and nothing is
  // returned, so that a GPU step need not wait for it. Saves what Backward
  // needs, as Forward does. This default runs Forward (which may read the
  // loss back) and adds the value; CrossEntropyLoss reads nothing back when
  // its targets were checked on the host.
  virtual absl::Status ForwardAccumulate(const Tensor& logits,
                                         const Tensor& targets, double weight,
                                         Tensor* sum);
  // dLoss/dlogits of the last Forward, times `scale`; releases the saved
  // tensors.
  virtual absl::StatusOr<Tensor> Backward(float scale = 1.0f) = 0;
  // The target value that is left out of the mean.
  virtual int64_t ignore_index() const = 0;
  // Non-ignored targets in the last Forward.
  virtual int64_t count() const = 0;
  // A new loss of the same kind and settings (the normalizer too) with
  // nothing saved (e.g. for an evaluation pass that must not disturb a
  // pending Backward).
  virtual std::unique_ptr<LossFunction> Clone() const = 0;

  // The divisor of the mean: > 0 replaces the count of non-ignored targets,
  // so that the loss is their sum / normalizer (and its gradient follows);
  // 0 (the default): the count. A step whose loss is the token mean over a
  // global batch sets it to that batch's counted targets per micro-batch and
  // rank (recipe/step/step.h), so that micro-batches of unequal counts
  // weigh by their tokens. InvalidArgument unless finite and >= 0.
  absl::Status set_normalizer(double normalizer);
  double normalizer() const { return normalizer_; }
  // The divisor for `count` counted targets: normalizer() when > 0, else
  // `count` (MeanDivisor).
  double Divisor(int64_t count) const {
    return MeanDivisor(count, normalizer_);
  }
  // What turns a mean over `count` counted targets (or its gradient) into
  // the normalizer's: count / normalizer(); exactly 1 without a normalizer
  // or counted targets. For losses computed as the count's mean (loss
  // parallel, the fused LM head).
  double CountToNormalizer(int64_t count) const {
    return normalizer_ > 0 && count > 0
               ? static_cast<double>(count) / normalizer_
               : 1.0;
  }
  // d(mean)/d(row loss) of a counted row for `count` counted targets, times
  // `scale`: scale / Divisor(count) (f32; 0 when count is 0).
  float MeanGradient(float scale, int64_t count) const;

 private:
  double normalizer_ = 0;
};

// mean over i with targets[i] != ignore_index of -log softmax(logits[i])[t]
// (the sum over them / normalizer() when one is set).
class CrossEntropyLoss : public LossFunction {
 public:
  // gradient_in_place: Backward writes dlogits over the saved logits
  // (saving a [tokens, V] buffer at the step's peak) -- for callers that do
  // not read the logits after Backward, as models::Transformer's loss.
  explicit CrossEntropyLoss(int64_t ignore_index = -100,
                            bool gradient_in_place = false)
      : ignore_index_(ignore_index), gradient_in_place_(gradient_in_place) {}

  // logits [.., V] (f32/bf16/f16) with one row per element of targets
  // (i32/i64, in [0, V) or ignore_index). Saves logits and targets for
  // Backward. On meta tensors it only validates shapes and returns 0.
  absl::StatusOr<float> Forward(const Tensor& logits,
                                const Tensor& targets) override;
  // The per-row losses summed on the device and added times weight / count
  // (f32) to *sum: no host read when the targets were checked on the host
  // (Tensor::ids_checked_below) and ignore_index is negative, since then
  // every target counts.
  absl::Status ForwardAccumulate(const Tensor& logits, const Tensor& targets,
                                 double weight, Tensor* sum) override;
  // dLoss/dlogits of the last Forward's mean, times `scale` (logits' shape
  // and dtype; the scale is applied in f32 before the cast, so a loss scale
  // for fp16 or a 1/micro-batches factor costs no extra pass); then releases
  // the saved tensors (a second Backward needs another Forward).
  // InvalidArgument unless scale is finite and > 0.
  absl::StatusOr<Tensor> Backward(float scale = 1.0f) override;

  int64_t ignore_index() const override { return ignore_index_; }
  int64_t count() const override { return count_; }
  std::unique_ptr<LossFunction> Clone() const override;
  bool gradient_in_place() const { return gradient_in_place_; }

 private:
  // Forward's checks, per-row losses (f32) and count (0 on meta tensors);
  // saves logits and targets.
  absl::Status RowLosses(const Tensor& logits, const Tensor& targets,
                         Tensor* losses);

  int64_t ignore_index_;
  bool gradient_in_place_;
  int64_t count_ = 0;
  Tensor saved_logits_;
  Tensor saved_targets_;
  Tensor saved_lse_;  // [N] f32: each row's log-sum-exp
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_LOSS_H_
