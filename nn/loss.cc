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
namespace {

// Targets that are not `ignore_index` (targets is i32 or i64, not meta).
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

}  // namespace

absl::StatusOr<float> CrossEntropyLoss::Forward(const Tensor& logits,
                                                const Tensor& targets) {
  saved_logits_ = Tensor();
  saved_targets_ = Tensor();
  count_ = 0;
  if (!targets.defined()) {
    return absl::InvalidArgumentError("CrossEntropyLoss: undefined targets");
  }
  FSDPP_ASSIGN_OR_RETURN(
      Tensor losses,
      EmptyTemporary({targets.numel()}, DType::kF32, logits.device()));
  FSDPP_RETURN_IF_ERROR(
      Annotate(CrossEntropy(logits, targets, ignore_index_, &losses),
               "CrossEntropyLoss"));
  float loss = 0.0f;
  // Allocated on meta too, so that a dry run (plan/) sees what a real one does.
  FSDPP_ASSIGN_OR_RETURN(Tensor sum,
                         EmptyTemporary({1}, DType::kF32, logits.device()));
  if (!logits.is_meta()) {
    FSDPP_ASSIGN_OR_RETURN(count_, CountTargets(targets, ignore_index_));
    if (count_ > 0) {
      FSDPP_RETURN_IF_ERROR(fsdpp::Sum(losses, &sum));
      FSDPP_ASSIGN_OR_RETURN(float total, Item(sum));
      loss = static_cast<float>(static_cast<double>(total) / count_);
    }
  }
  saved_logits_ = logits;
  saved_targets_ = targets;
  return loss;
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
  FSDPP_RETURN_IF_ERROR(Fill(&dlosses, count_ > 0 ? scale / count_ : 0.0f));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor dlogits,
      EmptyTemporary(logits.shape(), logits.dtype(), logits.device()));
  FSDPP_RETURN_IF_ERROR(
      Annotate(CrossEntropyBackward(logits, saved_targets_, ignore_index_,
                                    dlosses, &dlogits),
               "CrossEntropyLoss backward"));
  saved_logits_ = Tensor();
  saved_targets_ = Tensor();
  return dlogits;
}

}  // namespace nn
}  // namespace fsdpp
