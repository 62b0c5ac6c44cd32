// LayerNorm layer; see layer_norm.h.
#include "nn/layer_norm.h"

#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {

LayerNorm::LayerNorm(int64_t dim, float eps, bool bias, DType dtype)
    : Module("LayerNorm"), dim_(dim), eps_(eps) {
  weight_ = AddParameter("weight", {dim}, InitSpec::Ones(), dtype);
  if (bias) bias_ = AddParameter("bias", {dim}, InitSpec::Zeros(), dtype);
}

absl::StatusOr<Tensor> LayerNorm::ForwardImpl(const Tensor& x) {
  FSDPP_ASSIGN_OR_RETURN(Tensor x_rows, AsRows(x, dim_, "input"));
  const int64_t rows = x_rows.dim(0);
  FSDPP_ASSIGN_OR_RETURN(Tensor y,
                         EmptyActivation(x.shape(), x.dtype(), x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor mean,
                         EmptyActivation({rows}, DType::kF32, x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor rstd,
                         EmptyActivation({rows}, DType::kF32, x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor w, CastTo(weight_->data, x.dtype()));
  Tensor b;
  if (bias_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(b, CastTo(bias_->data, x.dtype()));
  }
  FSDPP_RETURN_IF_ERROR(fsdpp::LayerNorm(x, w, bias_ != nullptr ? &b : nullptr,
                                         eps_, &y, &mean, &rstd));
  saved_x_ = x;
  saved_mean_ = mean;
  saved_rstd_ = rstd;
  return y;
}

absl::StatusOr<Tensor> LayerNorm::BackwardImpl(const Tensor& dy_in) {
  FSDPP_ASSIGN_OR_RETURN(
      NormBackwardStart start,
      StartNormBackward(kind(), saved_x_, dy_in, weight_->data));
  auto& [x, dy, w, dx] = start;
  // LayerNormBackward accumulates into dweight and dbias of x's dtype.
  FSDPP_ASSIGN_OR_RETURN(GradSink dw, GradSink::For(weight_, x.dtype(), false));
  if (bias_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(GradSink db, GradSink::For(bias_, x.dtype(), false));
    FSDPP_RETURN_IF_ERROR(LayerNormBackward(dy, x, w, saved_mean_, saved_rstd_,
                                            &dx, dw.target(), db.target()));
    FSDPP_RETURN_IF_ERROR(db.Commit());
  } else {
    FSDPP_RETURN_IF_ERROR(LayerNormBackward(dy, x, w, saved_mean_, saved_rstd_,
                                            &dx, dw.target(), nullptr));
  }
  FSDPP_RETURN_IF_ERROR(dw.Commit());
  ReleaseOwnSavedTensors();
  return dx;
}

}  // namespace nn
}  // namespace fsdpp
