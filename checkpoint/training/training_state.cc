// A training run's state as one checkpoint; see training_state.h.
#include "checkpoint/training/training_state.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status.h"

namespace fsdpp {
namespace {

constexpr char kStepKey[] = "optim/step";

}  // namespace

absl::StatusOr<StateDict> ModelAndOptimizerState(
    const std::vector<fsdp::ShardedParameter*>& params, AdamW& adamw,
    FrozenMasters frozen, const std::vector<std::string>& frozen_names) {
  StateDict state;
  for (fsdp::ShardedParameter* sp : params) {
    if (sp == nullptr) {
      return absl::InvalidArgumentError("training state: a null parameter");
    }
    if (!sp->requires_grad && frozen == FrozenMasters::kReference &&
        std::find(frozen_names.begin(), frozen_names.end(), sp->name) !=
            frozen_names.end()) {
      continue;
    }
    FSDPP_RETURN_IF_ERROR(state.AddDTensor("model/" + sp->name, sp->master));
  }
  FSDPP_ASSIGN_OR_RETURN(OptimizerStateDict optim, adamw.StateDict());
  for (auto& [name, t] : optim.tensors) {
    FSDPP_RETURN_IF_ERROR(state.AddDTensor("optim/" + name, t));
  }
  return state;
}

std::string FrozenRecord::ToString() const {
  if (names.empty()) return "";
  std::string out = absl::StrCat("source: ", source, "\n");
  for (const std::string& name : names) {
    absl::StrAppend(&out, "frozen: ", name, "\n");
  }
  return out;
}

absl::StatusOr<FrozenRecord> FrozenRecord::Parse(const std::string& text,
                                                 const std::string& where) {
  FrozenRecord record;
  if (text.empty()) return record;
  const std::vector<std::string> lines =
      absl::StrSplit(text, '\n', absl::SkipEmpty());
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    if (i == 0 && absl::StartsWith(line, "source: ")) {
      record.source = line.substr(8);
    } else if (i > 0 && absl::StartsWith(line, "frozen: ")) {
      record.names.push_back(line.substr(8));
    } else {
      return absl::DataLossError(absl::StrCat(
          where, ": ", kFrozenKey, " line ", i + 1, " \"", line, "\" is not \"",
          i == 0 ? "source" : "frozen", ": ...\""));
    }
  }
  if (record.source.empty() || record.names.empty()) {
    return absl::DataLossError(absl::StrCat(
        where, ": ", kFrozenKey, " names no source or no parameter"));
  }
  return record;
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
