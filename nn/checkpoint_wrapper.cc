// Activation checkpointing; see checkpoint_wrapper.h.
#include "nn/checkpoint_wrapper.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
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

std::vector<Tensor*> ActivationCheckpoint::SavedTensorSlots() {
  std::vector<Tensor*> slots = store_.Slots();
  slots.push_back(&saved_x_);
  return slots;
}

absl::StatusOr<Tensor> ActivationCheckpoint::RunInner(const Tensor& x,
                                                      bool replay) {
  if (!forward_selective_) return inner_->Forward(x);
  SelectiveRecompute::Scope scope(&store_, replay);
  return inner_->Forward(x);
}

absl::StatusOr<Tensor> ActivationCheckpoint::ForwardImpl(const Tensor& x) {
  store_.Clear();
  forward_selective_ = selective_;
  absl::StatusOr<Tensor> y = RunInner(x, /*replay=*/false);
  inner_->ReleaseSavedTensors();
  if (!y.ok()) {
    store_.Clear();
    return y;
  }
  saved_x_ = x;
  return y;
}

absl::StatusOr<Tensor> ActivationCheckpoint::BackwardImpl(const Tensor& dy) {
  if (!saved_x_.defined()) return NoSavedForward(kind());
  recomputing_ = true;
  absl::StatusOr<Tensor> recomputed = RunInner(saved_x_, /*replay=*/true);
  recomputing_ = false;
  // What the recomputation reused is now held by the modules that saved it.
  store_.Clear();
  if (!recomputed.ok()) {
    inner_->ReleaseSavedTensors();
    return Annotate(recomputed.status(), "recomputing forward");
  }
  // The recomputed output is not needed: only what the subtree saved is.
  recomputed = Tensor();
  saved_x_ = Tensor();
  return inner_->Backward(dy);
}

absl::StatusOr<CheckpointPolicy> CheckpointPolicy::Parse(
    absl::string_view text) {
  const absl::string_view given = text;
  if (text == "none" || text == "false") return None();
  if (text == "full" || text == "true") return Full();
  if (text == "selective") return Selective();
  int n = 0;
  if (absl::ConsumePrefix(&text, "every:") && absl::SimpleAtoi(text, &n) &&
      n >= 1) {
    return Every(n);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("activation checkpointing \"", given,
                   "\" must be \"none\", \"full\", \"every:N\" (N >= 1) or "
                   "\"selective\""));
}

std::string CheckpointPolicy::ToString() const {
  switch (kind) {
    case Kind::kNone:
      return "none";
    case Kind::kFull:
      return "full";
    case Kind::kEvery:
      return absl::StrCat("every:", every);
    case Kind::kSelective:
      return "selective";
  }
  return "none";
}

bool CheckpointPolicy::Wraps(int64_t index) const {
  switch (kind) {
    case Kind::kNone:
      return false;
    case Kind::kEvery:
      return every >= 1 && index % every == 0;
    case Kind::kFull:
    case Kind::kSelective:
      return true;
  }
  return false;
}

int64_t CheckpointPolicy::FullyRecomputed(int64_t blocks) const {
  switch (kind) {
    case Kind::kFull:
      return blocks;
    case Kind::kEvery:
      return every >= 1 ? (blocks + every - 1) / every : 0;
    case Kind::kNone:
    case Kind::kSelective:
      return 0;
  }
  return 0;
}

}  // namespace nn
}  // namespace fsdpp
