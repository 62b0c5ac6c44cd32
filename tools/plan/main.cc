// plan: memory and step time of a training run before it starts.
//
//   bazel run //tools/plan -- [--config=FILE] [--set=field=value ...]
//       [--world=N] [--ranks_per_node=N] [--device=cpu|h100|h200]
//       [--memory_budget=80GiB] [--search] [--nocalibrate]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "core/cli.h"
#include "tools/plan/plan_tool.h"

ABSL_FLAG(std::string, config, "",
          "trainer config (textproto); empty: the trainer's embedded default");
ABSL_FLAG(std::vector<std::string>, set, {},
          "SECTION.FIELD=VALUE: override a config field (repeatable), as the "
          "trainer's --set");
ABSL_FLAG(int, world, 2, "ranks (the trainer's default --nproc_per_node)");
ABSL_FLAG(int, ranks_per_node, 0, "ranks per node; 0: all on one node");
ABSL_FLAG(std::string, device, "cpu",
          "cpu (this machine, rates measured) or h100 / h200 (data sheets)");
ABSL_FLAG(bool, calibrate, true,
          "cpu: measure the matmul and Gloo rates here (about a second)");
ABSL_FLAG(std::string, memory_budget, "",
          "memory per rank (80GiB, 24G, ...); also ranks the strategies");
ABSL_FLAG(bool, search, false,
          "rank ZeRO-2/3, activation checkpointing, offload and micro-batch "
          "settings against the device's memory");
ABSL_FLAG(int, rank, -1,
          "the rank to plan; -1: the one with the largest peak (rank 0, or "
          "the first rank of the pipeline stage with the most)");

namespace {

constexpr char kUsage[] =
    "usage: plan [--config=FILE] [--set=k=v ...] [--world=N] "
    "[--device=cpu|h100|h200] [--memory_budget=SIZE] [--search]\n"
    "  Plans a training run's memory and step time without running it.\n";

int Main(int argc, char** argv) {
  const fsdpp::CommandLine line =
      fsdpp::ParseCommandLineOrExit(argc, argv, kUsage, {"set"});
  if (!line.positional.empty()) {
    std::fprintf(stderr, "plan: unexpected argument \"%s\"\n%s",
                 line.positional[0].c_str(), kUsage);
    return 2;
  }
  fsdpp::plan_tool::PlanToolOptions o;
  o.config_path = absl::GetFlag(FLAGS_config);
  if (!o.config_path.empty() && o.config_path[0] != '/') {
    if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY")) {
      o.config_path = std::string(dir) + "/" + o.config_path;
    }
  }
  auto it = line.repeated.find("set");
  if (it != line.repeated.end()) o.overrides = it->second;
  o.world = absl::GetFlag(FLAGS_world);
  o.ranks_per_node = absl::GetFlag(FLAGS_ranks_per_node);
  o.device = absl::GetFlag(FLAGS_device);
  o.calibrate = absl::GetFlag(FLAGS_calibrate);
  o.search = absl::GetFlag(FLAGS_search);
  o.rank = absl::GetFlag(FLAGS_rank);
  const std::string budget = absl::GetFlag(FLAGS_memory_budget);
  if (!budget.empty()) {
    absl::StatusOr<int64_t> bytes = fsdpp::plan_tool::ParseBytes(budget);
    if (!bytes.ok()) {
      std::fprintf(stderr, "plan: --memory_budget: %s\n%s",
                   std::string(bytes.status().message()).c_str(), kUsage);
      return 2;
    }
    o.memory_budget = *bytes;
  }
  absl::StatusOr<std::string> out = fsdpp::plan_tool::RunPlanTool(o);
  if (!out.ok()) {
    std::fprintf(stderr, "plan: %s\n", out.status().ToString().c_str());
    return 1;
  }
  std::fputs(out->c_str(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv); }
