// Activation checkpointing; see checkpoint_wrapper.h.
#include "nn/checkpoint_wrapper.h"

#include <utility>

#include "core/logging.h"
#include "core/status.h"
#include "nn/layer_util.h"

namespace fsdpp {
namespace nn {

ActivationCheckpoint::ActivationCheckpoint(std::unique_ptr<Module> inner)
    : Module("ActivationCheckpoint") {
  CHECK(inner != nullptr) << "ActivationCheckpoint: null inner module";
  inner_ = AddModule("", std::move(inner));
}

absl::StatusOr<Tensor> ActivationCheckpoint::ForwardImpl(const Tensor& x) {
  FSDPP_ASSIGN_OR_RETURN(Tensor y, inner_->Forward(x));
  inner_->ReleaseSavedTensors();
  saved_x_ = x;
  return y;
}

absl::StatusOr<Tensor> ActivationCheckpoint::BackwardImpl(const Tensor& dy) {
  if (!saved_x_.defined()) return NoSavedForward(kind());
  recomputing_ = true;
  absl::StatusOr<Tensor> recomputed = inner_->Forward(saved_x_);
  recomputing_ = false;
  if (!recomputed.ok()) {
    inner_->ReleaseSavedTensors();
    return Annotate(recomputed.status(), "recomputing forward");
  }
  // The recomputed output is not needed: only what the subtree saved is.
  recomputed = Tensor();
  saved_x_ = Tensor();
  return inner_->Backward(dy);
}

}  // namespace nn
}  // namespace fsdpp
