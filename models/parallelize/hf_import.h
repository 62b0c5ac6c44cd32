// Initialising an FSDP-sharded model from a Hugging Face model directory
// without ever holding the whole model: each rank reads, from the
// memory-mapped safetensors shards, only the box of each parameter its
// master holds (DTensor::local_box: FSDP's rows, HSDP's replicas, tensor
// parallelism's pieces, GPT-2's fused c_attn as its [3, C, C] view), one
// read buffer at a time, and converts it into the master in place.
//
// Everything is checked before the first value is written: config.json
// against the model's config (models::CheckHfConfig), every tensor's
// presence, shape and dtype (models::PlanHfImport), and that every master's
// layout is one this reader handles.
#ifndef FSDPP_MODELS_PARALLELIZE_HF_IMPORT_H_
#define FSDPP_MODELS_PARALLELIZE_HF_IMPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "models/hf_directory.h"
#include "models/lora.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {

// What one rank's import did.
struct HfShardedImportStats {
  int64_t tensors = 0;
  // Bytes copied out of the files by this rank (its boxes, in the files'
  // dtypes).
  uint64_t bytes_read = 0;
  // The largest read buffer this rank held (one at a time).
  uint64_t largest_buffer_bytes = 0;
};

// Initialises the masters of the sharded `model` (fsdp::FullyShard applied,
// sharded weights materialised) from `dir`. Errors: config.json missing or
// mismatching, PlanHfImport's, Unimplemented for a master layout other than
// the parameter's shape or its one-dim-split view; nothing is written then.
// LoRA's adapters (models/lora.h), which no base model holds, keep their
// initialisation.
absl::StatusOr<HfShardedImportStats> ImportHfSharded(const HfDirectory& dir,
                                                     Transformer* model);

// Initialises the LoRA adapters of the sharded `model` (models/lora.h,
// `lora` its options) from a PEFT adapter directory `dir`:
// adapter_config.json (peft_type LORA, r and lora_alpha equal to the
// options') and adapter_model.safetensors ("base_model.model.<HF module>
// .lora_A.weight" [r, in], ".lora_B.weight" [out, r]: what `ckpt export
// --format=peft` writes and PEFT saves). The adapted modules are the file's
// tensors' (target_modules may be short names): each of the model's
// adapters must be there with its shape, and a whole model must have an
// adapter for each module the file holds. Each rank copies only its boxes
// (the adapters are small: each tensor is read whole). Every check runs
// before the first value is written; errors name the file and the tensor.
absl::StatusOr<HfShardedImportStats> ImportPeftAdapterSharded(
    const std::string& dir, const LoraOptions& lora, Transformer* model);

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_PARALLELIZE_HF_IMPORT_H_
