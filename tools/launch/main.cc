// The `launch` binary: a torchrun-like launcher for fsdpp programs.
//
//   launch --nproc_per_node=4 -- bazel-bin/trainer/train --steps=100
//
// Flags are parsed by hand rather than with absl flags because everything
// from PROGRAM on must reach the program untouched, even arguments that look
// like the launcher's own flags. Usage errors exit 2.
#include <cstdio>
#include <string>
#include <vector>

#include "runtime/launch.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const auto options = fsdpp::launch::ParseLaunchArgs(args);
  if (!options.ok()) {
    std::fprintf(stderr, "launch: %s\n\n%s",
                 std::string(options.status().message()).c_str(),
                 fsdpp::launch::LaunchUsage().c_str());
    return 2;
  }
  if (options->help) {
    std::fputs(fsdpp::launch::LaunchUsage().c_str(), stdout);
    return 0;
  }
  return fsdpp::launch::RunLaunch(*options);
}
