// LM head fused with the mean cross-entropy; see linear_cross_entropy.h.
#include "nn/linear_cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "nn/layer_util.h"
#include "nn/loss.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {

int64_t LinearCrossEntropy::AutoChunkRows(int64_t vocab, DType dtype) {
  const int64_t row_bytes = std::max<int64_t>(1, vocab) * DTypeSize(dtype);
  return std::max<int64_t>(16, kAutoChunkBytes / row_bytes / 16 * 16);
}

bool LinearCrossEntropy::CanFuseLoss() const {
  return bias() == nullptr && !weight()->has_piece() && !has_transforms();
}

absl::Status LinearCrossEntropy::ArmLoss(const Tensor& targets,
                                         int64_t ignore_index,
                                         int64_t chunk_rows) {
  armed_targets_ = Tensor();
  if (!CanFuseLoss()) {
    return absl::FailedPreconditionError(
        "LinearCrossEntropy: the fused loss needs the whole weight, no bias "
        "and no layout transforms");
  }
  if (chunk_rows < 1 && chunk_rows != kAutoChunk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LinearCrossEntropy: chunk_rows must be >= 1 or kAutoChunk, got ",
        chunk_rows));
  }
  if (!targets.defined() ||
      (targets.dtype() != DType::kI32 && targets.dtype() != DType::kI64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LinearCrossEntropy: targets must be i32/i64, got ",
                     targets.ToString()));
  }
  armed_targets_ = targets;
  ignore_index_ = ignore_index;
  chunk_rows_ = chunk_rows;
  return absl::OkStatus();
}

std::vector<Tensor*> LinearCrossEntropy::SavedTensorSlots() {
  std::vector<Tensor*> slots = Linear::SavedTensorSlots();
  slots.push_back(&saved_dx_);
  slots.push_back(&saved_dw_);
  return slots;
}

absl::StatusOr<Tensor> LinearCrossEntropy::ForwardImpl(const Tensor& x) {
  saved_dx_ = Tensor();
  saved_dw_ = Tensor();
  last_fused_ = false;
  if (!armed_targets_.defined()) return Linear::ForwardImpl(x);
  const Tensor targets = armed_targets_;
  armed_targets_ = Tensor();
  int64_t chunk = chunk_rows_;
  if (chunk == kAutoChunk) {
    chunk = AutoChunkRows(out_features(), x.dtype());
    const int64_t rows = x.numel() / std::max<int64_t>(1, in_features());
    if (rows <= chunk + in_features()) return Linear::ForwardImpl(x);
    const int64_t chunks = (rows + chunk - 1) / chunk;
    chunk = (rows + chunks - 1) / chunks;
  }
  last_fused_ = true;
  absl::StatusOr<Tensor> sum = FusedForward(x, targets, chunk);
  if (!sum.ok()) {
    saved_dx_ = Tensor();
    saved_dw_ = Tensor();
  }
  return sum;
}

absl::StatusOr<Tensor> LinearCrossEntropy::FusedForward(
    const Tensor& x, const Tensor& all_targets, int64_t chunk_rows) {
  const int64_t in = in_features(), vocab = out_features();
  FSDPP_ASSIGN_OR_RETURN(Tensor x_rows, AsRows(x, in, "input"));
  const int64_t rows = x_rows.dim(0);
  if (all_targets.numel() != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("LinearCrossEntropy: targets ", all_targets.ToString(),
                     " must have one target per row of the input ",
                     x.ToString(), " (", rows, ")"));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor targets, all_targets.Reshape({rows}));
  const DType dtype = x.dtype();
  const Device device = x.device();
  count_ = 0;
  if (!x.is_meta()) {
    FSDPP_ASSIGN_OR_RETURN(count_, CountTargets(targets, ignore_index_));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor w, CastTo(weight()->data, dtype));
  // Kept for Backward: d(mean)/dx and d(mean)/dW.
  FSDPP_ASSIGN_OR_RETURN(Tensor dx, EmptyActivation(x.shape(), dtype, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor dx_rows, dx.Reshape({rows, in}));
  Tensor dw;
  if (weight()->requires_grad) {
    FSDPP_ASSIGN_OR_RETURN(dw, EmptyActivation({vocab, in}, dtype, device));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor losses,
                         EmptyTemporary({rows}, DType::kF32, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor dlosses,
                         EmptyTemporary({rows}, DType::kF32, device));
  FSDPP_RETURN_IF_ERROR(
      Fill(&dlosses, count_ > 0 ? 1.0f / static_cast<float>(count_) : 0.0f));
  const int64_t chunk = std::min(chunk_rows, rows);
  FSDPP_ASSIGN_OR_RETURN(Tensor logits_buffer,
                         EmptyTemporary({chunk, vocab}, dtype, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor lse_buffer,
                         EmptyTemporary({chunk}, DType::kF32, device));
  for (int64_t start = 0; start < rows; start += chunk) {
    const int64_t n = std::min(chunk, rows - start);
    FSDPP_ASSIGN_OR_RETURN(Tensor x_c, x_rows.Narrow(start, n));
    FSDPP_ASSIGN_OR_RETURN(Tensor t_c, targets.Narrow(start, n));
    FSDPP_ASSIGN_OR_RETURN(Tensor logits, logits_buffer.Narrow(0, n));
    FSDPP_ASSIGN_OR_RETURN(Tensor lse, lse_buffer.Narrow(0, n));
    FSDPP_ASSIGN_OR_RETURN(Tensor losses_c, losses.Narrow(start, n));
    FSDPP_ASSIGN_OR_RETURN(Tensor dlosses_c, dlosses.Narrow(start, n));
    FSDPP_ASSIGN_OR_RETURN(Tensor dx_c, dx_rows.Narrow(start, n));
    MatmulOptions head;
    head.transpose_b = true;
    FSDPP_RETURN_IF_ERROR(Matmul(x_c, w, &logits, head));
    FSDPP_RETURN_IF_ERROR(
        CrossEntropy(logits, t_c, ignore_index_, &losses_c, &lse));
    // In place: each row is read before it is written.
    FSDPP_RETURN_IF_ERROR(CrossEntropyBackward(logits, t_c, ignore_index_,
                                               dlosses_c, &logits, &lse));
    FSDPP_RETURN_IF_ERROR(Matmul(logits, w, &dx_c));
    if (dw.defined()) {
      MatmulOptions grad;
      grad.transpose_a = true;
      grad.beta = start == 0 ? 0.0f : 1.0f;
      FSDPP_RETURN_IF_ERROR(Matmul(logits, x_c, &dw, grad));
    }
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor sum, EmptyTemporary({1}, DType::kF32, device));
  FSDPP_RETURN_IF_ERROR(Sum(losses, &sum));
  saved_dx_ = dx;
  saved_dw_ = dw;
  return sum;
}

absl::StatusOr<Tensor> LinearCrossEntropy::BackwardImpl(const Tensor& dy) {
  if (!saved_dx_.defined()) return Linear::BackwardImpl(dy);
  absl::StatusOr<Tensor> dx = FusedBackward();
  saved_dx_ = Tensor();
  saved_dw_ = Tensor();
  return dx;
}

absl::StatusOr<Tensor> LinearCrossEntropy::FusedBackward() {
  const float scale = backward_scale_;
  if (!std::isfinite(scale) || scale <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("LinearCrossEntropy: the backward scale must be finite "
                     "and > 0, got ",
                     scale));
  }
  Tensor dx = saved_dx_;
  if (scale != 1.0f) FSDPP_RETURN_IF_ERROR(Scale(dx, scale, &dx));
  if (saved_dw_.defined() && weight()->requires_grad) {
    FSDPP_ASSIGN_OR_RETURN(
        GradSink sink, GradSink::ForWrite(weight(), saved_dw_.dtype(), true));
    FSDPP_ASSIGN_OR_RETURN(Tensor dw,
                           CastTo(saved_dw_, sink.target()->dtype()));
    if (sink.accumulate()) {
      FSDPP_RETURN_IF_ERROR(Axpy(scale, dw, sink.target()));
    } else {
      FSDPP_RETURN_IF_ERROR(Scale(dw, scale, sink.target()));
    }
    FSDPP_RETURN_IF_ERROR(sink.Commit());
  }
  return dx;
}

}  // namespace nn
}  // namespace fsdpp
