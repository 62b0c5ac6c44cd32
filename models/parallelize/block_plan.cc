#include "models/parallelize/block_plan.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fsdpp {
namespace models {

absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyBlockPlan(
    Transformer* model, ModelFamily family, absl::string_view caller,
    const fsdp::FsdpPlanOptions& options) {
  if (model == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(caller, ": null model"));
  }
  if (model->config().family != family) {
    return absl::InvalidArgumentError(
        absl::StrCat(caller, ": model '", model->config().name, "' is a ",
                     ModelFamilyName(model->config().family),
                     " model (use that family's plan)"));
  }
  const std::vector<Module*> blocks(model->blocks().begin(),
                                    model->blocks().end());
  absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
      fsdp::ShardBlocksThenRoot(model, blocks, options);
  if (!units.ok()) return Annotate(units.status(), caller);
  return units;
}

}  // namespace models
}  // namespace fsdpp
