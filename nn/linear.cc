// Linear layer; see linear.h.
#include "nn/linear.h"

#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/status.h"
#include "nn/dropout.h"
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

absl::Status Linear::EnableLora(int64_t rank, float alpha, float dropout,
                                uint64_t dropout_key) {
  if (rank < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Linear::EnableLora: rank must be >= 1, got ", rank));
  }
  if (!(dropout >= 0.0f && dropout < 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Linear::EnableLora: dropout must be in [0, 1), got ", dropout));
  }
  if (lora_a_ != nullptr || !owns_weight_ || weight_->has_piece()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Linear::EnableLora: this layer ",
                     lora_a_ != nullptr ? "has an adapter already"
                     : !owns_weight_    ? "shares its weight (tied)"
                                        : "holds a tensor-parallel piece"));
  }
  const float bound = 1.0f / std::sqrt(static_cast<float>(in_features_));
  auto a = std::make_unique<Linear>(in_features_, rank, /*bias=*/false, 0.0f,
                                    weight_->dtype);
  a->weight()->init = InitSpec::Uniform(-bound, bound);
  auto b = std::make_unique<Linear>(rank, out_features_, /*bias=*/false, 0.0f,
                                    weight_->dtype);
  b->weight()->init = InitSpec::Zeros();
  lora_a_ = AddModule("lora_A", std::move(a));
  lora_b_ = AddModule("lora_B", std::move(b));
  lora_scale_ = alpha / static_cast<float>(rank);
  lora_dropout_ = dropout;
  lora_dropout_key_ = dropout_key;
  weight_->requires_grad = false;
  if (bias_ != nullptr) bias_->requires_grad = false;
  return absl::OkStatus();
}

absl::Status Linear::LoraDropout(const Tensor& in, const DropoutRows& rows,
                                 Tensor* out) const {
  // The features' place in the whole layer (a row-wise tensor-parallel
  // piece holds a slice of them).
  const bool piece = weight_->has_piece();
  return KeyedDropout(in, lora_dropout_, lora_dropout_key_,
                      piece ? weight_->piece.offset.back() : 0,
                      piece ? weight_->piece.layout.back() : in_features_, rows,
                      out);
}

absl::StatusOr<Tensor> Linear::LoraInput(const Tensor& x) const {
  const DropoutRows* rows = DropoutRows::Active();
  if (lora_dropout_ == 0.0f || rows == nullptr) return x;
  FSDPP_ASSIGN_OR_RETURN(Tensor dropped,
                         EmptyActivation(x.shape(), x.dtype(), x.device()));
  FSDPP_RETURN_IF_ERROR(
      Annotate(LoraDropout(x, *rows, &dropped), "LoRA dropout"));
  return dropped;
}

absl::Status Linear::LoraInputGradient(Tensor* dx) const {
  const DropoutRows* rows = DropoutRows::Active();
  if (lora_dropout_ == 0.0f || rows == nullptr) return absl::OkStatus();
  return Annotate(LoraDropout(*dx, *rows, dx), "LoRA dropout backward");
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
    if (lora_a_ != nullptr) {
      // The adapter's layers replay too (their saved inputs); the output
      // replayed already holds their contribution.
      FSDPP_ASSIGN_OR_RETURN(const Tensor xa, LoraInput(x));
      FSDPP_ASSIGN_OR_RETURN(Tensor h, lora_a_->Forward(xa));
      FSDPP_RETURN_IF_ERROR(lora_b_->Forward(h).status());
    }
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
  if (lora_a_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(const Tensor xa, LoraInput(x));
    FSDPP_ASSIGN_OR_RETURN(Tensor h, lora_a_->Forward(xa));
    FSDPP_ASSIGN_OR_RETURN(Tensor z, lora_b_->Forward(h));
    FSDPP_RETURN_IF_ERROR(Axpy(lora_scale_, z, &y));
  }
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
    FSDPP_ASSIGN_OR_RETURN(GradSink dw,
                           GradSink::ForWrite(weight_, dtype, true));
    MatmulOptions options;
    options.transpose_a = true;
    options.beta = dw.accumulate() ? 1.0f : 0.0f;
    FSDPP_RETURN_IF_ERROR(Matmul(dy_rows, x_rows, dw.target(), options));
    FSDPP_RETURN_IF_ERROR(dw.Commit());
  }
  // db += sum over rows of dy.
  if (bias_ != nullptr && bias_->requires_grad) {
    FSDPP_ASSIGN_OR_RETURN(GradSink db, GradSink::For(bias_, dtype, true));
    FSDPP_RETURN_IF_ERROR(SumRowsAccumulate(dy_rows, db.target()));
    FSDPP_RETURN_IF_ERROR(db.Commit());
  }
  if (lora_a_ != nullptr) {
    // dz = (alpha / r) dy; dx += dz B A through the adapter's layers.
    FSDPP_ASSIGN_OR_RETURN(Tensor dz,
                           EmptyTemporary(dy.shape(), dtype, dy.device()));
    FSDPP_RETURN_IF_ERROR(Scale(dy, lora_scale_, &dz));
    FSDPP_ASSIGN_OR_RETURN(Tensor dh, lora_b_->Backward(dz));
    FSDPP_ASSIGN_OR_RETURN(Tensor dx_lora, lora_a_->Backward(dh));
    FSDPP_RETURN_IF_ERROR(LoraInputGradient(&dx_lora));
    FSDPP_RETURN_IF_ERROR(Add(dx, dx_lora, &dx));
  }
  saved_x_ = Tensor();
  return dx;
}

}  // namespace nn
}  // namespace fsdpp
