// LoRA adapters on a model; see lora.h.
#include "models/lora.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "formats/json.h"
#include "nn/linear.h"
#include "tensor/ops.h"

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

// The dropout key of the layer named `name`: FNV-1a of the name, the same
// in every process and at every layout (pipeline parts keep the names).
uint64_t DropoutKey(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

std::string LoraJson(const LoraOptions& options) {
  std::vector<std::string> targets;
  for (const std::string& t : options.targets) targets.push_back(JsonQuote(t));
  return absl::StrCat(
      "{\"r\": ", options.rank,
      ", \"lora_alpha\": ", absl::StrFormat("%.9g", options.alpha),
      options.dropout > 0
          ? absl::StrCat(", \"lora_dropout\": ",
                         absl::StrFormat("%.7g", options.dropout))
          : std::string(),
      ", \"target_modules\": [", absl::StrJoin(targets, ", "), "]}");
}

absl::StatusOr<LoraOptions> ParseLoraJson(const std::string& text,
                                          const std::string& where) {
  const auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(where, ": LoRA record: ", what));
  };
  absl::StatusOr<Json> json = ParseJson(text);
  if (!json.ok()) return bad(std::string(json.status().message()));
  const Json* r = json->Find("r");
  const Json* alpha = json->Find("lora_alpha");
  const Json* targets = json->Find("target_modules");
  if (r == nullptr || !r->is_int64() || alpha == nullptr ||
      !alpha->is_number() || targets == nullptr || !targets->is_array()) {
    return bad(
        "needs an integer r, a number lora_alpha and an array "
        "target_modules");
  }
  LoraOptions options;
  options.rank = r->int64_value();
  options.alpha = static_cast<float>(alpha->number_value());
  if (const Json* dropout = json->Find("lora_dropout"); dropout != nullptr) {
    if (!dropout->is_number() || !(dropout->number_value() >= 0) ||
        !(dropout->number_value() < 1)) {
      return bad("lora_dropout is not a number in [0, 1)");
    }
    options.dropout = static_cast<float>(dropout->number_value());
  }
  for (const Json& t : targets->array_value()) {
    if (!t.is_string()) return bad("a target_modules entry is not a string");
    options.targets.push_back(t.string_value());
  }
  if (!options.enabled() || options.targets.empty()) {
    return bad(absl::StrCat("r ", options.rank, " with ",
                            options.targets.size(), " target(s)"));
  }
  return options;
}

absl::StatusOr<std::vector<std::string>> MergeLoraAdapters(Module* model) {
  std::vector<std::string> merged;
  for (auto& [name, m] : model->NamedModules()) {
    auto* linear = dynamic_cast<nn::Linear*>(m);
    if (linear == nullptr || linear->lora_a() == nullptr) continue;
    Parameter* w = linear->weight();
    const Tensor& a = linear->lora_a()->weight()->data;
    Tensor& b = linear->lora_b()->weight()->data;
    if (w->data.is_meta() || a.is_meta() || b.is_meta() ||
        w->data.dtype() != DType::kF32 || !w->data.device().is_cpu()) {
      return absl::FailedPreconditionError(
          absl::StrCat("MergeLoraAdapters: ", name,
                       " is not materialised in f32 on the CPU"));
    }
    FSDPP_ASSIGN_OR_RETURN(
        Tensor ba, Tensor::Empty(w->data.shape(), DType::kF32, Device::Cpu()));
    FSDPP_RETURN_IF_ERROR(Matmul(b, a, &ba));
    FSDPP_RETURN_IF_ERROR(Axpy(linear->lora_scale(), ba, &w->data));
    FSDPP_RETURN_IF_ERROR(Zero(&b));
    merged.push_back(name);
  }
  return merged;
}

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
    FSDPP_RETURN_IF_ERROR(
        Annotate(linear->EnableLora(options.rank, options.alpha,
                                    options.dropout, DropoutKey(name)),
                 "adapting " + name));
    names.push_back(name);
  }
  return names;
}

}  // namespace models
}  // namespace fsdpp
