// RmsNorm layer; see rms_norm.h.
#include "nn/rms_norm.h"

#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {

RmsNorm::RmsNorm(int64_t dim, float eps, DType dtype)
    : Module("RmsNorm"), dim_(dim), eps_(eps) {
  weight_ = AddParameter("weight", {dim}, InitSpec::Ones(), dtype);
}

absl::StatusOr<Tensor> RmsNorm::ForwardImpl(const Tensor& x) {
  FSDPP_ASSIGN_OR_RETURN(Tensor x_rows, AsRows(x, dim_, "input"));
  FSDPP_ASSIGN_OR_RETURN(Tensor y,
                         EmptyActivation(x.shape(), x.dtype(), x.device()));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor rstd, EmptyActivation({x_rows.dim(0)}, DType::kF32, x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor w, CastTo(weight_->data, x.dtype()));
  FSDPP_RETURN_IF_ERROR(fsdpp::RmsNorm(x, w, eps_, &y, &rstd));
  saved_x_ = x;
  saved_rstd_ = rstd;
  return y;
}

absl::StatusOr<Tensor> RmsNorm::BackwardImpl(const Tensor& dy_in) {
  FSDPP_ASSIGN_OR_RETURN(
      NormBackwardStart start,
      StartNormBackward(kind(), saved_x_, dy_in, weight_->data));
  auto& [x, dy, w, dx] = start;
  // RmsNormBackward accumulates into a dweight of x's dtype.
  FSDPP_ASSIGN_OR_RETURN(GradSink dw, GradSink::For(weight_, x.dtype(), false));
  FSDPP_RETURN_IF_ERROR(
      RmsNormBackward(dy, x, w, saved_rstd_, &dx, dw.target()));
  FSDPP_RETURN_IF_ERROR(dw.Commit());
  ReleaseOwnSavedTensors();
  return dx;
}

}  // namespace nn
}  // namespace fsdpp
