// ckpt: inspect, verify and convert fsdpp checkpoints (see ckpt_lib.h).
//
//   ckpt inspect [--verify] CKPT/step-N
//   ckpt convert CKPT/step-N out.safetensors
//   ckpt convert in.safetensors CKPT [--step=N]
#include <iostream>

#include "tools/ckpt/ckpt_lib.h"

int main(int argc, char** argv) {
  return fsdpp::ckpt::Main(argc, argv, std::cout, std::cerr);
}
