// Linear layer; see linear.h.
#include "nn/linear.h"

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {

Linear::Linear(int64_t in_features, int64_t out_features, bool bias,
               float init_std, DType dtype)
    : Module("Linear"), in_features_(in_features), out_features_(out_features) {
  weight_ = AddParameter("weight", {out_features, in_features},
                         InitSpec::Normal(init_std), dtype);
  if (bias)
    bias_ = AddParameter("bias", {out_features}, InitSpec::Zeros(), dtype);
}

Linear::Linear(Parameter* shared_weight, bool bias)
    : Module("Linear"), weight_(shared_weight), owns_weight_(false) {
  CHECK(shared_weight != nullptr) << "Linear: null shared weight";
  CHECK_EQ(shared_weight->shape.size(), 2u)
      << "Linear: shared weight must be 2-D";
  out_features_ = shared_weight->shape[0];
  in_features_ = shared_weight->shape[1];
  ShareParameter("weight", shared_weight);
  if (bias) {
    bias_ = AddParameter("bias", {out_features_}, InitSpec::Zeros(),
                         shared_weight->dtype);
  }
}

absl::StatusOr<Tensor> Linear::ForwardImpl(const Tensor& x) {
  const int64_t in = local_in_features(), out = local_out_features();
  FSDPP_ASSIGN_OR_RETURN(Tensor x_rows, AsRows(x, in, "input"));
  // Selective checkpointing reuses the matmul's output, unless a layout
  // transform (tensor parallelism's collectives, which may work in place)
  // follows it: that layer recomputes.
  SelectiveRecompute* selective =
      has_transforms() ? nullptr : SelectiveRecompute::Active();
  if (selective != nullptr && selective->replaying()) {
    FSDPP_ASSIGN_OR_RETURN(std::vector<Tensor> y, selective->Replay(this));
    saved_x_ = x;
    return y[0];
  }
  const DType dtype = x.dtype();
  Shape out_shape = x.shape();
  out_shape.back() = out;
  FSDPP_ASSIGN_OR_RETURN(Tensor y,
                         EmptyActivation(out_shape, dtype, x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor y_rows, y.Reshape({x_rows.dim(0), out}));
  FSDPP_ASSIGN_OR_RETURN(Tensor w, CastTo(weight_->data, dtype));
  MatmulOptions options;
  options.transpose_b = true;
  Tensor b;
  if (bias_ != nullptr && add_bias_in_forward_) {
    FSDPP_ASSIGN_OR_RETURN(b, CastTo(bias_->data, dtype));
    options.bias = &b;  // Added in the matmul's own pass.
  }
  FSDPP_RETURN_IF_ERROR(Matmul(x_rows, w, &y_rows, options));
  saved_x_ = x;
  if (selective != nullptr) selective->Record(this, {y});
  return y;
}

absl::StatusOr<Tensor> Linear::BackwardImpl(const Tensor& dy_in) {
  if (!saved_x_.defined()) return NoSavedForward(kind());
  const Tensor x = saved_x_;
  const DType dtype = x.dtype();
  const int64_t in = local_in_features(), out = local_out_features();
  Shape out_shape = x.shape();
  out_shape.back() = out;
  if (!dy_in.defined() || dy_in.shape() != out_shape) {
    return absl::InvalidArgumentError(absl::StrCat("dy must be ",
                                                   ShapeToString(out_shape),
                                                   " (the output "
                                                   "shape), got ",
                                                   dy_in.ToString()));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor dy, CastTo(dy_in, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor x_rows, AsRows(x, in, "input"));
  FSDPP_ASSIGN_OR_RETURN(Tensor dy_rows, AsRows(dy, out, "dy"));

  // dx = dy W.
  FSDPP_ASSIGN_OR_RETURN(Tensor w, CastTo(weight_->data, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor dx,
                         EmptyTemporary(x.shape(), dtype, x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor dx_rows, dx.Reshape(x_rows.shape()));
  FSDPP_RETURN_IF_ERROR(Matmul(dy_rows, w, &dx_rows));

  // dW += dy^T x.
  if (weight_->requires_grad) {
    FSDPP_ASSIGN_OR_RETURN(GradSink dw, GradSink::For(weight_, dtype, true));
    MatmulOptions options;
    options.transpose_a = true;
    options.beta = 1.0f;
    FSDPP_RETURN_IF_ERROR(Matmul(dy_rows, x_rows, dw.target(), options));
    FSDPP_RETURN_IF_ERROR(dw.Commit());
  }
  // db += sum over rows of dy.
  if (bias_ != nullptr && bias_->requires_grad) {
    FSDPP_ASSIGN_OR_RETURN(GradSink db, GradSink::For(bias_, dtype, true));
    FSDPP_RETURN_IF_ERROR(SumRowsAccumulate(dy_rows, db.target()));
    FSDPP_RETURN_IF_ERROR(db.Commit());
  }
  saved_x_ = Tensor();
  return dx;
}

}  // namespace nn
}  // namespace fsdpp
