// Cross-entropy loss; see loss.h.
#include "nn/loss.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {

absl::StatusOr<int64_t> CountTargets(const Tensor& targets,
                                     int64_t ignore_index) {
  // Checked on the host to lie in [0, bound): none is a negative
  // ignore_index, and the ids need no copy back from a GPU.
  if (targets.ids_checked_below() > 0 && ignore_index < 0) {
    return targets.numel();
  }
  FSDPP_ASSIGN_OR_RETURN(const std::vector<int64_t> ids, targets.ToInts());
  int64_t count = 0;
  for (int64_t id : ids) count += id != ignore_index;
  return count;
}

absl::Status CheckLossSum(const Tensor* sum, Device device,
                          absl::string_view who) {
  if (sum != nullptr && sum->defined() && sum->dtype() == DType::kF32 &&
      sum->numel() == 1 && sum->device() == device) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(who,
                   ": the loss sum must be an f32 tensor of one element on the "
                   "logits' device (",
                   device.ToString(), "), got ",
                   sum == nullptr ? std::string("null") : sum->ToString()));
}

absl::StatusOr<float> MeanOfTotal(const Tensor& total, int64_t count,
                                  double normalizer) {
  if (count == 0) return 0.0f;
  FSDPP_ASSIGN_OR_RETURN(float value, Item(total));
  return static_cast<float>(static_cast<double>(value) /
                            MeanDivisor(count, normalizer));
}

absl::Status AccumulateMean(const Tensor& total, int64_t count, double weight,
                            Tensor* sum, double normalizer) {
  if (count == 0) return absl::OkStatus();
  return Axpy(static_cast<float>(weight / MeanDivisor(count, normalizer)),
              total, sum);
}

absl::Status LossFunction::set_normalizer(double normalizer) {
  if (!std::isfinite(normalizer) || normalizer < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss: the normalizer must be finite and >= 0, got ", normalizer));
  }
  normalizer_ = normalizer;
  return absl::OkStatus();
}

float LossFunction::MeanGradient(float scale, int64_t count) const {
  if (count == 0) return 0.0f;
  if (normalizer_ > 0) return static_cast<float>(scale / normalizer_);
  return scale / count;
}

std::unique_ptr<LossFunction> CrossEntropyLoss::Clone() const {
  auto out =
      std::make_unique<CrossEntropyLoss>(ignore_index_, gradient_in_place_);
  out->set_normalizer(normalizer()).IgnoreError();  // valid: it is ours
  return out;
}

absl::Status LossFunction::ForwardAccumulate(const Tensor& logits,
                                             const Tensor& targets,
                                             double weight, Tensor* sum) {
  FSDPP_ASSIGN_OR_RETURN(float loss, Forward(logits, targets));
  if (sum == nullptr || sum->is_meta()) return absl::OkStatus();
  FSDPP_ASSIGN_OR_RETURN(Tensor value,
                         EmptyTemporary({1}, DType::kF32, sum->device()));
  FSDPP_RETURN_IF_ERROR(Fill(&value, loss));
  return Axpy(static_cast<float>(weight), value, sum);
}

absl::Status CrossEntropyLoss::RowLosses(const Tensor& logits,
                                         const Tensor& targets,
                                         Tensor* losses) {
  saved_logits_ = Tensor();
  saved_targets_ = Tensor();
  saved_lse_ = Tensor();
  count_ = 0;
  if (!targets.defined()) {
    return absl::InvalidArgumentError("CrossEntropyLoss: undefined targets");
  }
  FSDPP_ASSIGN_OR_RETURN(
      Tensor rows,
      EmptyTemporary({targets.numel()}, DType::kF32, logits.device()));
  // The rows' log-sum-exp, saved for the backward's one pass.
  FSDPP_ASSIGN_OR_RETURN(
      Tensor lse,
      EmptyActivation({targets.numel()}, DType::kF32, logits.device()));
  FSDPP_RETURN_IF_ERROR(
      Annotate(CrossEntropy(logits, targets, ignore_index_, &rows, &lse),
               "CrossEntropyLoss"));
  if (!logits.is_meta()) {
    FSDPP_ASSIGN_OR_RETURN(count_, CountTargets(targets, ignore_index_));
  }
  *losses = std::move(rows);
  saved_logits_ = logits;
  saved_targets_ = targets;
  saved_lse_ = std::move(lse);
  return absl::OkStatus();
}

absl::StatusOr<float> CrossEntropyLoss::Forward(const Tensor& logits,
                                                const Tensor& targets) {
  Tensor losses;
  FSDPP_RETURN_IF_ERROR(RowLosses(logits, targets, &losses));
  // Allocated on meta too, so that a dry run (plan/) sees what a real one does.
  FSDPP_ASSIGN_OR_RETURN(Tensor sum,
                         EmptyTemporary({1}, DType::kF32, logits.device()));
  if (count_ == 0) return 0.0f;  // meta, or nothing counted
  FSDPP_RETURN_IF_ERROR(fsdpp::Sum(losses, &sum));
  return MeanOfTotal(sum, count_, normalizer());
}

absl::Status CrossEntropyLoss::ForwardAccumulate(const Tensor& logits,
                                                 const Tensor& targets,
                                                 double weight, Tensor* sum) {
  FSDPP_RETURN_IF_ERROR(CheckLossSum(sum, logits.device(), "CrossEntropyLoss"));
  Tensor losses;
  FSDPP_RETURN_IF_ERROR(RowLosses(logits, targets, &losses));
  FSDPP_ASSIGN_OR_RETURN(Tensor total,
                         EmptyTemporary({1}, DType::kF32, logits.device()));
  if (count_ == 0) return absl::OkStatus();  // meta, or nothing counted
  FSDPP_RETURN_IF_ERROR(fsdpp::Sum(losses, &total));
  return AccumulateMean(total, count_, weight, sum, normalizer());
}

absl::StatusOr<Tensor> CrossEntropyLoss::Backward(float scale) {
  if (!saved_logits_.defined()) {
    return absl::FailedPreconditionError(
        "CrossEntropyLoss: Backward without a Forward");
  }
  if (!std::isfinite(scale) || scale <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CrossEntropyLoss: Backward scale must be finite and > 0, got ",
        scale));
  }
  const Tensor& logits = saved_logits_;
  FSDPP_ASSIGN_OR_RETURN(
      Tensor dlosses,
      EmptyTemporary({saved_targets_.numel()}, DType::kF32, logits.device()));
  FSDPP_RETURN_IF_ERROR(Fill(&dlosses, MeanGradient(scale, count_)));
  Tensor dlogits = logits;  // in place: row by row, read before written
  if (!gradient_in_place_) {
    FSDPP_ASSIGN_OR_RETURN(
        dlogits,
        EmptyTemporary(logits.shape(), logits.dtype(), logits.device()));
  }
  FSDPP_RETURN_IF_ERROR(
      Annotate(CrossEntropyBackward(logits, saved_targets_, ignore_index_,
                                    dlosses, &dlogits, &saved_lse_),
               "CrossEntropyLoss backward"));
  saved_logits_ = Tensor();
  saved_targets_ = Tensor();
  saved_lse_ = Tensor();
  return dlogits;
}

}  // namespace nn
}  // namespace fsdpp
