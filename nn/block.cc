// Transformer block; see block.h.
#include "nn/block.h"

#include <utility>

#include "core/logging.h"
#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {
namespace {

// out = a + b in a new activation buffer.
absl::StatusOr<Tensor> AddNew(const Tensor& a, const Tensor& b) {
  FSDPP_ASSIGN_OR_RETURN(Tensor out,
                         EmptyActivation(a.shape(), a.dtype(), a.device()));
  FSDPP_RETURN_IF_ERROR(Add(a, b, &out));
  return out;
}

// branch_dx + residual_dy, written into branch_dx unless it aliases the
// caller's residual_dy.
absl::StatusOr<Tensor> AddResidualGrad(Tensor branch_dx,
                                       const Tensor& residual_dy) {
  if (!branch_dx.defined()) {
    return absl::InvalidArgumentError("a branch returned no input gradient");
  }
  if (branch_dx.SharesStorageWith(residual_dy)) {
    FSDPP_ASSIGN_OR_RETURN(
        Tensor out, EmptyTemporary(residual_dy.shape(), residual_dy.dtype(),
                                   residual_dy.device()));
    FSDPP_RETURN_IF_ERROR(Add(branch_dx, residual_dy, &out));
    return out;
  }
  FSDPP_RETURN_IF_ERROR(Add(branch_dx, residual_dy, &branch_dx));
  return branch_dx;
}

}  // namespace

Block::Block(std::unique_ptr<Module> norm1, std::unique_ptr<Module> attn,
             std::unique_ptr<Module> norm2, std::unique_ptr<Module> mlp,
             const ChildNames& names, const std::string& kind)
    : Module(kind) {
  CHECK(norm1 != nullptr && attn != nullptr && norm2 != nullptr &&
        mlp != nullptr)
      << kind << ": null child";
  norm1_ = AddModule(names.norm1, std::move(norm1));
  attn_ = AddModule(names.attn, std::move(attn));
  norm2_ = AddModule(names.norm2, std::move(norm2));
  mlp_ = AddModule(names.mlp, std::move(mlp));
}

absl::StatusOr<Tensor> Block::ForwardImpl(const Tensor& x) {
  FSDPP_ASSIGN_OR_RETURN(Tensor h, norm1_->Forward(x));
  FSDPP_ASSIGN_OR_RETURN(Tensor a, attn_->Forward(h));
  FSDPP_ASSIGN_OR_RETURN(Tensor y, AddNew(x, a));
  FSDPP_ASSIGN_OR_RETURN(Tensor h2, norm2_->Forward(y));
  FSDPP_ASSIGN_OR_RETURN(Tensor m, mlp_->Forward(h2));
  return AddNew(y, m);
}

absl::StatusOr<Tensor> Block::BackwardImpl(const Tensor& dz) {
  // z = y + mlp(norm2(y)): dy = dz + norm2'(mlp'(dz)).
  FSDPP_ASSIGN_OR_RETURN(Tensor dh2, mlp_->Backward(dz));
  FSDPP_ASSIGN_OR_RETURN(Tensor dy_branch, norm2_->Backward(dh2));
  FSDPP_ASSIGN_OR_RETURN(Tensor dy, AddResidualGrad(std::move(dy_branch), dz));
  // y = x + attn(norm1(x)): dx = dy + norm1'(attn'(dy)).
  FSDPP_ASSIGN_OR_RETURN(Tensor dh, attn_->Backward(dy));
  FSDPP_ASSIGN_OR_RETURN(Tensor dx_branch, norm1_->Backward(dh));
  return AddResidualGrad(std::move(dx_branch), dy);
}

}  // namespace nn
}  // namespace fsdpp
