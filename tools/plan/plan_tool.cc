// tools/plan; see plan_tool.h.
#include "tools/plan/plan_tool.h"

#include <cctype>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "plan/planner.h"
#include "trainer/config.h"
#include "trainer/default_config.h"

namespace fsdpp {
namespace plan_tool {

absl::StatusOr<int64_t> ParseBytes(const std::string& text) {
  size_t i = 0;
  while (
      i < text.size() &&
      (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    ++i;
  }
  double value = 0;
  if (i == 0 || !absl::SimpleAtod(text.substr(0, i), &value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a size (e.g. 80GiB, 24G, 512MiB, or bytes)"));
  }
  const std::string unit = absl::AsciiStrToLower(text.substr(i));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  if (unit == "k" || unit == "kib") scale = 1024.0;
  if (unit == "m" || unit == "mib") scale = 1024.0 * 1024;
  if (unit == "g" || unit == "gib") scale = 1024.0 * 1024 * 1024;
  if (unit == "t" || unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  if (unit == "kb") scale = 1e3;
  if (unit == "mb") scale = 1e6;
  if (unit == "gb") scale = 1e9;
  if (unit == "tb") scale = 1e12;
  if (scale == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "': unknown unit '", text.substr(i),
        "' (B, KiB, MiB, GiB, TiB or K, M, G, T for binary; KB, MB, GB, TB "
        "for decimal)"));
  }
  return static_cast<int64_t>(std::llround(value * scale));
}

absl::StatusOr<std::string> RunPlanTool(const PlanToolOptions& o) {
  trainer::TrainConfig config;
  if (o.config_path.empty()) {
    FSDPP_ASSIGN_OR_RETURN(
        config, trainer::ParseTrainConfig(trainer::DefaultConfigText(),
                                          "<embedded default config>"));
  } else {
    FSDPP_ASSIGN_OR_RETURN(config, trainer::LoadTrainConfig(o.config_path));
  }
  FSDPP_RETURN_IF_ERROR(trainer::ApplyOverrides(o.overrides, &config));
  // A GPU plan resolves the config as the trainer does on one (e.g. its
  // defaults for CUDA), unless the config names its device.
  if (o.device != "cpu" && !config.training().has_device()) {
    config.mutable_training()->set_device("cuda");
  }
  if (o.world < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--world must be >= 1, got ", o.world));
  }
  FSDPP_ASSIGN_OR_RETURN(trainer::ResolvedTrainConfig rc,
                         trainer::ResolveTrainConfig(config, o.world));
  const int per_node = o.ranks_per_node > 0 ? o.ranks_per_node : o.world;
  FSDPP_ASSIGN_OR_RETURN(
      plan::DeviceSpec device,
      plan::DeviceByName(o.device, per_node, o.calibrate,
                         trainer::UsesSharedMemory(config, per_node, o.world)));
  if (o.memory_budget > 0) device.memory_bytes = o.memory_budget;
  FSDPP_ASSIGN_OR_RETURN(plan::Plan p,
                         plan::MakePlan(rc.model, rc.layout, device, o.rank));
  std::string out;
  // What the config resolution changed (trainer's header notes), first.
  for (const std::string& note : rc.notes) {
    absl::StrAppend(&out, "note: ", note, "\n");
  }
  absl::StrAppend(&out, plan::FormatPlan(p));
  if (!o.search && o.memory_budget <= 0) return out;
  FSDPP_ASSIGN_OR_RETURN(std::vector<plan::Candidate> ranked,
                         plan::SearchStrategies(rc.model, rc.layout, device));
  absl::StrAppendFormat(&out,
                        "\nStrategies at W=%d against %s per rank "
                        "(fitting ones fastest first):\n",
                        o.world, plan::FormatBytes(device.memory_bytes));
  int n = 0;
  for (const plan::Candidate& c : ranked) {
    absl::StrAppendFormat(
        &out, "%2d. %-62s %10s %8.3f s/step  %s\n", ++n,
        c.plan.layout.ToString(),
        plan::FormatBytes(c.plan.predicted_peak_bytes), c.plan.time.step_s,
        c.why_not.empty() ? "fits" : absl::StrCat("no: ", c.why_not));
  }
  if (!ranked.empty() && !ranked[0].why_not.empty()) {
    absl::StrAppend(&out, "None fits: ", plan::ExplainDoesNotFit(p, ranked),
                    "\n");
  }
  return out;
}

}  // namespace plan_tool
}  // namespace fsdpp
