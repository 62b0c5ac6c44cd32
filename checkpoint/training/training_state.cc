// A training run's state as one checkpoint; see training_state.h.
#include "checkpoint/training/training_state.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fsdpp {
namespace {

constexpr char kStepKey[] = "optim/step";

}  // namespace

absl::StatusOr<StateDict> ModelAndOptimizerState(
    const std::vector<fsdp::ShardedParameter*>& params, AdamW& adamw) {
  StateDict state;
  for (fsdp::ShardedParameter* sp : params) {
    if (sp == nullptr) {
      return absl::InvalidArgumentError("training state: a null parameter");
    }
    FSDPP_RETURN_IF_ERROR(state.AddDTensor("model/" + sp->name, sp->master));
  }
  FSDPP_ASSIGN_OR_RETURN(OptimizerStateDict optim, adamw.StateDict());
  for (auto& [name, t] : optim.tensors) {
    FSDPP_RETURN_IF_ERROR(state.AddDTensor("optim/" + name, t));
  }
  return state;
}

absl::StatusOr<TrainingState> TrainingState::Create(
    const std::vector<fsdp::ShardedParameter*>& params, AdamW* adamw) {
  if (adamw == nullptr) {
    return absl::InvalidArgumentError("training state: no optimizer");
  }
  FSDPP_ASSIGN_OR_RETURN(StateDict state,
                         ModelAndOptimizerState(params, *adamw));
  FSDPP_RETURN_IF_ERROR(state.AddBytes(kStepKey, "0"));
  return TrainingState(std::move(state), adamw);
}

absl::StatusOr<SaveResult> TrainingState::Save(const std::string& folder,
                                               int64_t step,
                                               const SaveOptions& options) {
  FSDPP_RETURN_IF_ERROR(
      state_.SetBytes(kStepKey, absl::StrCat(adamw_->step())));
  return fsdpp::Save(state_, folder, step, options);
}

absl::StatusOr<LoadResult> TrainingState::Load(const std::string& dir,
                                               const LoadOptions& options) {
  FSDPP_ASSIGN_OR_RETURN(LoadResult loaded, fsdpp::Load(&state_, dir, options));
  FSDPP_ASSIGN_OR_RETURN(std::string text, state_.bytes(kStepKey));
  int64_t step = 0;
  if (!absl::SimpleAtoi(text, &step) || step < 0) {
    return absl::DataLossError(absl::StrCat(
        dir, ": ", kStepKey, " is not a step count: \"", text, "\""));
  }
  FSDPP_RETURN_IF_ERROR(adamw_->SetStep(step));
  return loaded;
}

}  // namespace fsdpp
