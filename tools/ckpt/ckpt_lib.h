// The `ckpt` tool's commands as a library: inspect a DCP-style checkpoint
// (keys, kinds, dtypes, shapes, chunk layout, files, total bytes; optionally
// verify every checksum) and convert between checkpoints and safetensors.
//
// Conversion runs in one process and reads whole tensors (every chunk), so
// it needs memory for the largest conversion input. Byte values travel
// through safetensors as 1-D U8 tensors whose names are listed (as a JSON
// array) under the "fsdpp.bytes" metadata key; the step is kept under
// "fsdpp.step". Tensor names are the checkpoint keys unchanged; Hugging Face
// renaming is models/hf_adapter.h's business.
#ifndef FSDPP_TOOLS_CKPT_CKPT_LIB_H_
#define FSDPP_TOOLS_CKPT_CKPT_LIB_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace fsdpp {
namespace ckpt {

// Writes a description of the checkpoint `dir` (a step-N directory) to
// `out`. With `verify`, reads every chunk, checks every checksum and reports
// the first failure as the returned error.
absl::Status Inspect(const std::string& dir, bool verify, std::ostream& out);

// Writes every value of checkpoint `dir` to the safetensors file `path`.
absl::Status ConvertToSafetensors(const std::string& dir,
                                  const std::string& path);

// Saves the tensors of safetensors file `path` as checkpoint
// `<root>/step-<step>` (step < 0: the file's "fsdpp.step", else 0) and
// returns its directory. Unimplemented for dtypes fsdpp lacks.
absl::StatusOr<std::string> ConvertFromSafetensors(const std::string& path,
                                                   const std::string& root,
                                                   int64_t step = -1);

struct HfExportOptions {
  // The zoo config, for checkpoints that do not record their model
  // (models::kModelConfigKey); must be empty for the ones that do.
  std::string model;
  DType dtype = DType::kF32;
  uint64_t max_shard_bytes = uint64_t{5} << 30;
  // GPT-2 BPE files (encoder.json, vocab.bpe) to include as the directory's
  // vocab.json and merges.txt; empty: the run's, when its train/config says
  // it used the GPT-2 tokenizer (its data.tokenizer_dir, else
  // /usr/local/share/fsdpp/gpt2), else none.
  std::string tokenizer_dir;
  // The frozen parameters' source ("hf:DIR" or "seed N") instead of the
  // one the checkpoint records (train/frozen); empty: that one.
  std::string base_model;
  // "hf": the whole model (a LoRA run's adapters merged into their base
  // weights, W + (alpha / r) B A); "peft": a LoRA run's adapters alone in
  // PEFT's layout (adapter_config.json, adapter_model.safetensors).
  std::string format = "hf";
};

// Writes the model of checkpoint `dir` (its "model/<name>" values, in any
// layout the checkpoint was saved from) as the Hugging Face model directory
// `out_dir` (models/hf_directory.h); returns the files written. Frozen
// parameters, which the trainer's checkpoints reference rather than hold
// (checkpoint/training/training_state.h: FrozenRecord), come from the
// recorded source: the seed's initialisation (bitwise the run's) or the
// base model's directory. A LoRA run's checkpoint (train/lora) exports
// merged, or with format "peft" its adapters alone (no base needed).
absl::StatusOr<std::vector<std::string>> ExportHf(
    const std::string& dir, const std::string& out_dir,
    const HfExportOptions& options);

// Saves the model of the Hugging Face directory `hf_dir` as checkpoint
// `<root>/step-<step>` ("model/<name>" values in our layout and the model
// config record) and returns its directory. The model is `model_name` of the
// zoo (config.json checked against it), or, when empty, what config.json
// describes (models::ConfigFromHfJson).
absl::StatusOr<std::string> ImportHf(const std::string& hf_dir,
                                     const std::string& root,
                                     const std::string& model_name,
                                     int64_t step);

// The command's flags (tools/ckpt/main.cc defines them as absl flags).
struct Flags {
  bool verify = false;  // inspect: read every chunk and check its CRC-32C.
  int64_t step = -1;    // convert safetensors -> checkpoint: the step.
  std::string format;   // export: "hf".
  std::string dtype = "f32";    // export: the written float dtype.
  int64_t max_shard_mb = 5120;  // export: shard size limit.
  std::string model;            // export: zoo config of an old checkpoint.
  std::string tokenizer_dir;    // export: GPT-2 BPE files to include.
  std::string base_model;       // export: the frozen parameters' source.
};

// The usage text.
const char* Usage();

// Runs "inspect DIR" or "convert SRC DST" (`args`, the command first; SRC a
// checkpoint directory and DST a .safetensors file, or the reverse with DST
// the checkpoint root). Returns the exit code: 0 success, 1 error (printed
// to `err`), 2 usage (a flag that does not apply to the command included).
int Run(const std::vector<std::string>& args, const Flags& flags,
        std::ostream& out, std::ostream& err);

}  // namespace ckpt
}  // namespace fsdpp

#endif  // FSDPP_TOOLS_CKPT_CKPT_LIB_H_
