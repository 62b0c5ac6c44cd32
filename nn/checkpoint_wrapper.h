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
// Selective mode keeps, besides x, the outputs of the subtree's expensive
// ops (every Linear's matmul and the fused attention core, recorded in a
// SelectiveRecompute store) and recomputes only the cheap ops between them
// in backward (torchtitan's op-level "selective" AC): memory between none
// and full, almost no extra compute, gradients still bitwise the unwrapped
// module's.
//
// The inner module is a transparent child (added under the empty name), so
// wrapping changes no parameter name, hence no init stream and no checkpoint
// key: "blocks.3.mlp.fc.weight" stays that whether or not block 3 is wrapped.
#ifndef FSDPP_NN_CHECKPOINT_WRAPPER_H_
#define FSDPP_NN_CHECKPOINT_WRAPPER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nn/layer_util.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// Which blocks of a stack are checkpointed, and how (a model's
// activation-checkpointing setting).
struct CheckpointPolicy {
  enum class Kind {
    kNone,       // nothing recomputed
    kFull,       // every block: only its input kept
    kEvery,      // blocks 0, N, 2N, ... full; the others not at all
    kSelective,  // every block selective (matmul and attention outputs kept)
  };
  Kind kind = Kind::kNone;
  int every = 0;  // N of kEvery (>= 1)

  static CheckpointPolicy None() { return {}; }
  static CheckpointPolicy Full() { return {Kind::kFull, 0}; }
  static CheckpointPolicy Every(int n) { return {Kind::kEvery, n}; }
  static CheckpointPolicy Selective() { return {Kind::kSelective, 0}; }
  // "none", "full", "every:N" (N >= 1) or "selective"; "false" and "true"
  // mean none and full. InvalidArgument naming the accepted forms otherwise.
  static absl::StatusOr<CheckpointPolicy> Parse(absl::string_view text);
  // The Parse form ("none", "full", "every:2", "selective").
  std::string ToString() const;

  bool enabled() const { return kind != Kind::kNone; }
  // Whether block `index` goes through its checkpoint wrapper.
  bool Wraps(int64_t index) const;
  // Of `blocks` blocks, how many recompute their whole forward.
  int64_t FullyRecomputed(int64_t blocks) const;
  bool operator==(const CheckpointPolicy& o) const {
    return kind == o.kind && every == o.every;
  }
  bool operator!=(const CheckpointPolicy& o) const { return !(*this == o); }
};

// y = inner(x), storing only x between forward and backward (full), or x
// and the expensive ops' outputs (selective).
class ActivationCheckpoint : public Module {
 public:
  // `inner` must be non-null.
  explicit ActivationCheckpoint(std::unique_ptr<Module> inner);

  // The wrapped module.
  Module* inner() const { return inner_; }
  // True while Backward re-runs the inner forward (hooks can read it, e.g.
  // to skip work that only the first forward needs).
  bool recomputing() const { return recomputing_; }
  // Selective (true) or full (false, the default); takes effect at the next
  // Forward (a Backward follows the mode of its Forward).
  void set_selective(bool selective) { selective_ = selective; }
  bool selective() const { return selective_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override;

 private:
  // inner->Forward(x), in the pending Forward's mode (selective: recording,
  // or with `replay` reusing what was recorded).
  absl::StatusOr<Tensor> RunInner(const Tensor& x, bool replay);

  Module* inner_;
  Tensor saved_x_;
  bool recomputing_ = false;
  bool selective_ = false;
  bool forward_selective_ = false;  // the mode of the pending Forward
  SelectiveRecompute store_;
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_CHECKPOINT_WRAPPER_H_
