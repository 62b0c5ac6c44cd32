// LoRA adapters on a model; see lora.h.
#include "models/lora.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "nn/linear.h"

namespace fsdpp {
namespace models {
namespace {

bool TargetMatches(const std::string& target, const std::string& module) {
  // The whole name or any of its dot-separated tails (PEFT's suffix match).
  if (MatchesNamePattern(target, module)) return true;
  for (size_t dot = module.find('.'); dot != std::string::npos;
       dot = module.find('.', dot + 1)) {
    if (MatchesNamePattern(target, std::string_view(module).substr(dot + 1))) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool IsLoraParameter(const std::string& name) {
  return absl::StrContains(name, ".lora_A.") ||
         absl::StrContains(name, ".lora_B.") ||
         absl::StartsWith(name, "lora_A.") || absl::StartsWith(name, "lora_B.");
}

absl::StatusOr<std::vector<std::string>> AddLoraAdapters(
    Module* model, const LoraOptions& options, bool every_target) {
  if (options.rank < 1 || options.targets.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.lora: rank ", options.rank, " with ", options.targets.size(),
        " target(s); LoRA needs rank >= 1 and at least one target"));
  }
  std::vector<std::pair<std::string, nn::Linear*>> chosen;
  std::vector<bool> used(options.targets.size(), false);
  for (auto& [name, m] : model->NamedModules()) {
    auto* linear = dynamic_cast<nn::Linear*>(m);
    if (linear == nullptr) continue;
    bool match = false;
    for (size_t i = 0; i < options.targets.size(); ++i) {
      if (!TargetMatches(options.targets[i], name)) continue;
      used[i] = match = true;
      if (!linear->owns_weight() || linear->weight()->has_piece()) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.lora.targets \"", options.targets[i],
                         "\" matches ", name, ", which ",
                         linear->owns_weight() ? "holds a tensor-parallel piece"
                                               : "shares its weight (tied)",
                         ": LoRA adapts layers that own their whole weight"));
      }
    }
    if (match) chosen.emplace_back(name, linear);
  }
  for (size_t i = 0; i < options.targets.size(); ++i) {
    if (used[i] || !every_target) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("model.lora.targets \"", options.targets[i],
                     "\" matches no linear layer of the model"));
  }
  for (auto& [name, p] : model->NamedParameters()) p->requires_grad = false;
  std::vector<std::string> names;
  for (auto& [name, linear] : chosen) {
    FSDPP_RETURN_IF_ERROR(Annotate(
        linear->EnableLora(options.rank, options.alpha), "adapting " + name));
    names.push_back(name);
  }
  return names;
}

}  // namespace models
}  // namespace fsdpp
