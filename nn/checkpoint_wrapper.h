// Activation checkpointing: a wrapper that keeps only its input after
// forward and recomputes the wrapped module's activations in backward.
//
// Forward runs inner->Forward(x) (hooks fire as usual), then
// inner->ReleaseSavedTensors() frees everything the subtree saved, and only x
// is kept. Backward re-runs inner->Forward(x) — a full second forward, with
// the inner modules' pre-/post-forward hooks firing again (so FSDP unshards
// the parameters for the recomputation) and recomputing() true meanwhile —
// then runs inner->Backward(dy). Forward being deterministic, the gradients
// equal the unwrapped module's bitwise (modules with randomness, e.g.
// dropout, would have to replay their RNG offsets; none here do).
//
// The inner module is a transparent child (added under the empty name), so
// wrapping changes no parameter name, hence no init stream and no checkpoint
// key: "blocks.3.mlp.fc.weight" stays that whether or not block 3 is wrapped.
#ifndef FSDPP_NN_CHECKPOINT_WRAPPER_H_
#define FSDPP_NN_CHECKPOINT_WRAPPER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// y = inner(x), storing only x between forward and backward.
class ActivationCheckpoint : public Module {
 public:
  // `inner` must be non-null.
  explicit ActivationCheckpoint(std::unique_ptr<Module> inner);

  // The wrapped module.
  Module* inner() const { return inner_; }
  // True while Backward re-runs the inner forward (hooks can read it, e.g.
  // to skip work that only the first forward needs).
  bool recomputing() const { return recomputing_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override { return {&saved_x_}; }

 private:
  Module* inner_;
  Tensor saved_x_;
  bool recomputing_ = false;
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_CHECKPOINT_WRAPPER_H_
