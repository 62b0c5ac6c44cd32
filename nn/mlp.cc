// Feed-forward blocks; see mlp.h.
#include "nn/mlp.h"

#include <memory>

#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {

Mlp::Mlp(int64_t dim, int64_t hidden, float init_std, float proj_init_std,
         DType dtype)
    : Module("Mlp") {
  if (hidden == 0) hidden = 4 * dim;
  fc_ = AddModule("fc", std::make_unique<Linear>(dim, hidden, /*bias=*/true,
                                                 init_std, dtype));
  proj_ = AddModule("proj", std::make_unique<Linear>(hidden, dim, /*bias=*/true,
                                                     proj_init_std, dtype));
}

absl::StatusOr<Tensor> Mlp::ForwardImpl(const Tensor& x) {
  FSDPP_ASSIGN_OR_RETURN(Tensor h, fc_->Forward(x));
  FSDPP_ASSIGN_OR_RETURN(Tensor g,
                         EmptyActivation(h.shape(), h.dtype(), h.device()));
  FSDPP_RETURN_IF_ERROR(Gelu(h, &g));
  FSDPP_ASSIGN_OR_RETURN(Tensor y, proj_->Forward(g));
  saved_h_ = h;
  return y;
}

absl::StatusOr<Tensor> Mlp::BackwardImpl(const Tensor& dy) {
  if (!saved_h_.defined()) return NoSavedForward(kind());
  FSDPP_ASSIGN_OR_RETURN(Tensor dg, proj_->Backward(dy));
  // GeluBackward reads each element before writing it: dh may alias dg.
  FSDPP_RETURN_IF_ERROR(GeluBackward(saved_h_, dg, &dg));
  saved_h_ = Tensor();
  return fc_->Backward(dg);
}

SwiGlu::SwiGlu(int64_t dim, int64_t hidden, float init_std, float down_init_std,
               DType dtype)
    : Module("SwiGlu") {
  gate_ = AddModule("gate", std::make_unique<Linear>(
                                dim, hidden, /*bias=*/false, init_std, dtype));
  up_ = AddModule("up", std::make_unique<Linear>(dim, hidden, /*bias=*/false,
                                                 init_std, dtype));
  down_ =
      AddModule("down", std::make_unique<Linear>(hidden, dim, /*bias=*/false,
                                                 down_init_std, dtype));
}

absl::StatusOr<Tensor> SwiGlu::ForwardImpl(const Tensor& x) {
  FSDPP_ASSIGN_OR_RETURN(Tensor a, gate_->Forward(x));
  FSDPP_ASSIGN_OR_RETURN(Tensor b, up_->Forward(x));
  // p = silu(a) * b, the input down saves.
  FSDPP_ASSIGN_OR_RETURN(Tensor p,
                         EmptyActivation(a.shape(), a.dtype(), a.device()));
  FSDPP_RETURN_IF_ERROR(Silu(a, &p));
  FSDPP_RETURN_IF_ERROR(Mul(p, b, &p));
  FSDPP_ASSIGN_OR_RETURN(Tensor y, down_->Forward(p));
  saved_gate_ = a;
  saved_up_ = b;
  return y;
}

absl::StatusOr<Tensor> SwiGlu::BackwardImpl(const Tensor& dy) {
  if (!saved_gate_.defined()) return NoSavedForward(kind());
  const Tensor a = saved_gate_;
  const Tensor b = saved_up_;
  FSDPP_ASSIGN_OR_RETURN(Tensor dp, down_->Backward(dy));
  // d up = dp * silu(a); d silu = dp * b; d gate = SiluBackward(a, d silu).
  FSDPP_ASSIGN_OR_RETURN(Tensor db,
                         EmptyTemporary(a.shape(), a.dtype(), a.device()));
  FSDPP_RETURN_IF_ERROR(Silu(a, &db));
  FSDPP_RETURN_IF_ERROR(Mul(dp, db, &db));
  FSDPP_RETURN_IF_ERROR(Mul(dp, b, &dp));
  FSDPP_RETURN_IF_ERROR(SiluBackward(a, dp, &dp));
  ReleaseOwnSavedTensors();
  // Children's backward in reverse registration order: down, up, gate.
  FSDPP_ASSIGN_OR_RETURN(Tensor dx, up_->Backward(db));
  FSDPP_ASSIGN_OR_RETURN(Tensor dx_gate, gate_->Backward(dp));
  FSDPP_RETURN_IF_ERROR(Add(dx, dx_gate, &dx));
  return dx;
}

}  // namespace nn
}  // namespace fsdpp
