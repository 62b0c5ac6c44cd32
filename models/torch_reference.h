// Running the PyTorch reference scripts of models/testdata from a test:
// a shell command's exit status and output, and whether /usr/bin/python3
// can import torch (Debian's python3-torch; tools/setup.sh installs it).
#ifndef FSDPP_MODELS_TORCH_REFERENCE_H_
#define FSDPP_MODELS_TORCH_REFERENCE_H_

#include <optional>
#include <string>
#include <utility>

namespace fsdpp {
namespace models {

// Runs `command` through the shell; (exit status as pclose gives it,
// stdout + stderr).
std::pair<int, std::string> RunCommand(const std::string& command);

// Why the reference cannot run (python3 cannot import torch, with how to
// install it), or nullopt when it can. Tests skip on a reason, or fail when
// FSDPP_REQUIRE_TORCH is set (RequireTorch()).
std::optional<std::string> TorchMissing();

// Whether FSDPP_REQUIRE_TORCH is set: a missing torch fails the test.
bool RequireTorch();

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_TORCH_REFERENCE_H_
