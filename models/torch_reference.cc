#include "models/torch_reference.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace fsdpp {
namespace models {

std::pair<int, std::string> RunCommand(const std::string& command) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
  return {::pclose(pipe), output};
}

std::optional<std::string> TorchMissing() {
  const auto [status, output] =
      RunCommand("/usr/bin/python3 -c 'import torch'");
  if (status == 0) return std::nullopt;
  return absl::StrCat("/usr/bin/python3 cannot import torch (", output,
                      "); install it with: FSDPP_SETUP_EXTRA=python3-torch "
                      "bash tools/setup.sh");
}

bool RequireTorch() { return std::getenv("FSDPP_REQUIRE_TORCH") != nullptr; }

}  // namespace models
}  // namespace fsdpp
