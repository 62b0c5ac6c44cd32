// LoRA adapters on a model's linear layers, chosen by name (PEFT's
// LoraConfig with target_modules): each adapted nn::Linear gains lora_A
// [r, in] and lora_B [out, r] (nn::Linear::EnableLora: PEFT's names and
// initialisation, the output scaled by alpha / r), and every other
// parameter of the model is frozen (PEFT's default, bias "none").
#ifndef FSDPP_MODELS_LORA_H_
#define FSDPP_MODELS_LORA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nn/module.h"

namespace fsdpp {
namespace models {

struct LoraOptions {
  int64_t rank = 0;  // r; 0 = no adapters
  float alpha = 16.0f;
  // PEFT's lora_dropout on each adapter's input, in [0, 1); the masks are
  // keyed by the layer's name and the batch's rows (nn/dropout.h), so every
  // layout drops the same elements.
  float dropout = 0.0f;
  // Which linear layers: a target matches a module whose fully qualified
  // name, or a dot-separated tail of it, it matches (MatchesNamePattern;
  // PEFT's suffix rule): "c_attn", "attn.c_proj", "wq", "h.*.mlp.fc".
  // Modules that are not nn::Linear are passed over.
  std::vector<std::string> targets;

  bool enabled() const { return rank > 0; }
};

// The checkpoint key of the record below.
inline constexpr char kLoraKey[] = "train/lora";

// The options as checkpoints record them (kLoraKey), in PEFT's
// adapter_config.json spelling: {"r": 8, "lora_alpha": 16,
// "target_modules": ["c_attn", ...]}, with "lora_dropout": p when p > 0 (a
// record without it: 0).
std::string LoraJson(const LoraOptions& options);
// DataLoss naming `where` for text LoraJson did not write.
absl::StatusOr<LoraOptions> ParseLoraJson(const std::string& text,
                                          const std::string& where);

// Folds every adapter of `model` (materialised on the CPU, f32) into its
// base weight, W += (alpha / r) B A, and zeroes B, so the model computes
// the same with or without the adapters; returns the merged modules' names.
absl::StatusOr<std::vector<std::string>> MergeLoraAdapters(Module* model);

// Whether the parameter named `name` is a LoRA adapter's.
bool IsLoraParameter(const std::string& name);

// Adds an adapter to every nn::Linear of `model` a target matches and
// freezes every other parameter; returns the adapted modules' names in the
// model's order. InvalidArgument naming the target for a target that
// matches no linear layer, a tied (shared-weight) layer or a
// tensor-parallel piece among the matches, rank < 1 or no targets.
// `every_target`: false for a part of a model (a pipeline stage), whose
// layers some targets may all miss.
absl::StatusOr<std::vector<std::string>> AddLoraAdapters(
    Module* model, const LoraOptions& options, bool every_target = true);

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_LORA_H_
