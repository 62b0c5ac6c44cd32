// Hugging Face model directories: what `transformers` writes with
// save_pretrained and reads with from_pretrained.
//
//   config.json                          the architecture (GPT2LMHeadModel
//                                        or LlamaForCausalLM and its fields)
//   model.safetensors                    every tensor, or, above a size:
//   model-00001-of-0000N.safetensors     shards, and
//   model.safetensors.index.json         {"metadata": {"total_size": B},
//                                         "weight_map": {tensor: shard}}
//
// Design choices:
//  * Writing goes to a fresh folder beside the destination, renamed into
//    place when complete: a destination that exists and is not empty is
//    refused, and a failed export leaves no partial directory.
//  * Shards are filled in the tensors' order up to the size limit (a tensor
//    larger than the limit gets a shard of its own), as save_pretrained
//    does; names follow its model-KKKKK-of-NNNNN pattern.
//  * Reading opens (memory-maps) every shard the index names and checks, up
//    front, that each file exists and holds the tensors the index puts in it,
//    so an import fails before anything is loaded. Shard names must be plain
//    file names inside the directory.
//  * config.json is checked against the model config field by field; every
//    mismatch is listed in one error.
#ifndef FSDPP_MODELS_HF_DIRECTORY_H_
#define FSDPP_MODELS_HF_DIRECTORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "formats/safetensors/safetensors.h"
#include "models/config.h"
#include "models/hf_adapter.h"
#include "tensor/sharding.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace models {

// The config.json of `config` for `transformers` (GPT2LMHeadModel or
// LlamaForCausalLM), with torch_dtype from `dtype`. Unimplemented for
// configs HF's GPT-2 / Llama cannot describe (see HfNameMapping; Llama
// without RoPE on some layers).
absl::StatusOr<std::string> HfConfigJson(const TransformerConfig& config,
                                         DType dtype);

// Checks a config.json (its text; `where` names it in messages) against
// `config`: the architecture and every field that shapes the weights or the
// math (vocabulary, context, width, layers, heads, kv heads, MLP width,
// norm epsilon, rope theta and scaling, tied embeddings, activation).
// InvalidArgument listing every mismatch.
absl::Status CheckHfConfig(absl::string_view config_json,
                           const TransformerConfig& config,
                           const std::string& where);

// The model a config.json describes (GPT2LMHeadModel or LlamaForCausalLM;
// optional fields at transformers' defaults), named `name`; it passes
// CheckHfConfig against the same text. InvalidArgument naming `where` and
// the field for anything else.
absl::StatusOr<TransformerConfig> ConfigFromHfJson(
    absl::string_view config_json, const std::string& name,
    const std::string& where);

struct HfWriteOptions {
  // The float dtype of the written tensors (f32, bf16 or f16).
  DType dtype = DType::kF32;
  // Shard above this many bytes of tensor data (save_pretrained's 5 GB).
  uint64_t max_shard_bytes = uint64_t{5} << 30;
  // More files for the directory, (name, contents): the tokenizer's
  // vocab.json and merges.txt, say. Plain names, not the ones written here.
  std::vector<std::pair<std::string, std::string>> extra_files;
};

// How WriteHfDirectory lays tensors out: the files in order, each with its
// tensors' names, and the total tensor bytes (the index's total_size).
struct HfShardPlan {
  std::vector<std::pair<std::string, std::vector<std::string>>> files;
  uint64_t total_bytes = 0;
};

// The layout of tensors (name, HF shape) of float dtype `dtype` cut at
// `max_shard_bytes`: model.safetensors when one file holds them, else
// model-KKKKK-of-NNNNN.safetensors filled in order. Needs no data, so the
// layout of a model on the meta device can be planned (and checked).
HfShardPlan PlanHfShards(
    const std::vector<std::pair<std::string, Shape>>& tensors, DType dtype,
    uint64_t max_shard_bytes);

// Writes `tensors` (HF names, HF layout, in order: ExportHfTensors) and the
// config.json of `config` as the model directory `dir`, which must not
// exist or be empty. Returns the files written (config.json first).
absl::StatusOr<std::vector<std::string>> WriteHfDirectory(
    const std::string& dir, const TransformerConfig& config,
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const HfWriteOptions& options = {});

// A model directory opened for reading: one file or the shards of an index.
class HfDirectory final : public HfTensorSource {
 public:
  // Opens `dir`: its model.safetensors.index.json and every shard it names,
  // or its model.safetensors. NotFound when neither is there, or for a shard
  // file the index names that is missing; InvalidArgument for a malformed
  // index or one that puts a tensor in a file that does not hold it; the
  // safetensors reader's errors (DataLoss for a truncated file) name the
  // file. config.json is read when present.
  static absl::StatusOr<std::unique_ptr<HfDirectory>> Open(
      const std::string& dir);

  const SafetensorsFile* Find(const std::string& name) const override;
  std::vector<std::string> names() const override;
  std::string where() const override { return dir_; }

  // config.json's text; empty when the directory has none.
  const std::string& config_json() const { return config_json_; }
  // config.json's text, NotFound when the directory has none.
  absl::StatusOr<std::string> RequireConfigJson() const;
  // RequireConfigJson, then CheckHfConfig against `config`.
  absl::Status CheckConfig(const TransformerConfig& config) const;
  // The safetensors files, in name order.
  std::vector<std::string> files() const;

 private:
  HfDirectory() = default;
  std::string dir_;
  std::string config_json_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> tensors_;
};

// Box `box` (offset and shape in our layout) of `item`'s parameter, whose
// global shape is `ours`, read from its file: only the bytes the box covers
// (a transposed GPT-2 weight, one run per file row of the box), rows of a
// padded vocabulary past the file's as zeros. 1-D and 2-D parameters; a host
// tensor of the file's dtype allocated under `tag`, the only buffer used.
absl::StatusOr<Tensor> ReadHfBox(const HfImportItem& item, const Shape& ours,
                                 const Box& box,
                                 MemoryTag tag = MemoryTag::kOther);

// Checks the directory's config.json (required) against the model's config,
// then imports every parameter (ImportHfTensors).
absl::Status ImportHfDirectory(const HfDirectory& dir, Transformer* model);

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_HF_DIRECTORY_H_
