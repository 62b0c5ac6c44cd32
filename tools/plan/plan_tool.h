// tools/plan's work, as a library (main.cc parses the flags): a trainer
// config (the embedded default or a file, with --set overrides) at a world
// size, planned on a device; with a memory budget, the strategies that fit.
#ifndef FSDPP_TOOLS_PLAN_PLAN_TOOL_H_
#define FSDPP_TOOLS_PLAN_PLAN_TOOL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdpp {
namespace plan_tool {

struct PlanToolOptions {
  std::string config_path;             // empty: the trainer's embedded default
  std::vector<std::string> overrides;  // "field.path=value"
  int world = 2;
  int ranks_per_node = 0;  // 0: all ranks on one node
  std::string device = "cpu";
  bool calibrate = true;      // cpu: measure the rates here
  int64_t memory_budget = 0;  // bytes; 0: the device's memory
  bool search = false;        // rank the strategies against the budget
  int rank = -1;              // plan::kLargestRank
};

// "80GiB", "24G", "512MiB", "1.5TiB", "1000000" (bytes): InvalidArgument
// naming the text otherwise.
absl::StatusOr<int64_t> ParseBytes(const std::string& text);

// The plan's breakdown (and with `search` or a budget the ranked
// strategies), as printed.
absl::StatusOr<std::string> RunPlanTool(const PlanToolOptions& options);

}  // namespace plan_tool
}  // namespace fsdpp

#endif  // FSDPP_TOOLS_PLAN_PLAN_TOOL_H_
