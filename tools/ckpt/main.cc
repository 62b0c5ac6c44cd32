// ckpt: inspect, verify and convert fsdpp checkpoints (see ckpt_lib.h).
//
//   ckpt inspect [--verify] CKPT/step-N
//   ckpt convert CKPT/step-N out.safetensors
//   ckpt convert in.safetensors CKPT [--step=N]
#include <cstdint>
#include <iostream>

#include "absl/flags/flag.h"
#include "core/cli.h"
#include "tools/ckpt/ckpt_lib.h"

ABSL_FLAG(bool, verify, false,
          "inspect: also read every chunk and check its CRC-32C");
ABSL_FLAG(int64_t, step, -1,
          "convert IN.safetensors ROOT: save as ROOT/step-N (default: the "
          "file's fsdpp.step, else 0)");

int main(int argc, char** argv) {
  const fsdpp::CommandLine line =
      fsdpp::ParseCommandLineOrExit(argc, argv, fsdpp::ckpt::Usage());
  fsdpp::ckpt::Flags flags;
  flags.verify = absl::GetFlag(FLAGS_verify);
  flags.step = absl::GetFlag(FLAGS_step);
  return fsdpp::ckpt::Run(line.positional, flags, std::cout, std::cerr);
}
