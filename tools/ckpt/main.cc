// ckpt: inspect, verify and convert fsdpp checkpoints (see ckpt_lib.h).
//
//   ckpt inspect [--verify] CKPT/step-N
//   ckpt convert CKPT/step-N out.safetensors
//   ckpt convert in.safetensors CKPT [--step=N]
//   ckpt export CKPT/step-N OUT_DIR --format=hf [--dtype=bf16]
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "core/cli.h"
#include "tools/ckpt/ckpt_lib.h"

ABSL_FLAG(bool, verify, false,
          "inspect: also read every chunk and check its CRC-32C");
ABSL_FLAG(int64_t, step, -1,
          "convert IN.safetensors ROOT: save as ROOT/step-N (default: the "
          "file's fsdpp.step, else 0)");

ABSL_FLAG(std::string, format, "",
          "export: the output format (hf: a Hugging Face model directory)");
ABSL_FLAG(std::string, dtype, "f32", "export: f32, bf16 or f16 tensors");
ABSL_FLAG(int64_t, max_shard_mb, 5120,
          "export: shard the safetensors files above this many MiB");
ABSL_FLAG(std::string, tokenizer_dir, "",
          "export: GPT-2 BPE files (encoder.json, vocab.bpe) to include as "
          "vocab.json and merges.txt (default: the run's, when it used the "
          "GPT-2 tokenizer)");
ABSL_FLAG(std::string, base_model, "",
          "export: where the checkpoint's frozen parameters come from, when "
          "not from the source it records (hf:DIR: a base model moved since "
          "the run)");
ABSL_FLAG(std::string, model, "",
          "export: the zoo config of a checkpoint that does not record its "
          "model");

int main(int argc, char** argv) {
  const fsdpp::CommandLine line =
      fsdpp::ParseCommandLineOrExit(argc, argv, fsdpp::ckpt::Usage());
  fsdpp::ckpt::Flags flags;
  flags.verify = absl::GetFlag(FLAGS_verify);
  flags.step = absl::GetFlag(FLAGS_step);
  flags.format = absl::GetFlag(FLAGS_format);
  flags.dtype = absl::GetFlag(FLAGS_dtype);
  flags.max_shard_mb = absl::GetFlag(FLAGS_max_shard_mb);
  flags.model = absl::GetFlag(FLAGS_model);
  flags.tokenizer_dir = absl::GetFlag(FLAGS_tokenizer_dir);
  flags.base_model = absl::GetFlag(FLAGS_base_model);
  // Under `bazel run` relative paths mean the directory it was run from.
  std::vector<std::string> args = line.positional;
  const char* base = std::getenv("BUILD_WORKING_DIRECTORY");
  if (base != nullptr && base[0] != '\0') {
    for (size_t i = 1; i < args.size(); ++i) {
      if (!args[i].empty() && args[i][0] != '/') {
        args[i] = std::string(base) + "/" + args[i];
      }
    }
    const std::string& hf = flags.base_model;
    if (hf.size() > 3 && hf.compare(0, 3, "hf:") == 0 && hf[3] != '/') {
      flags.base_model = "hf:" + std::string(base) + "/" + hf.substr(3);
    }
  }
  return fsdpp::ckpt::Run(args, flags, std::cout, std::cerr);
}
