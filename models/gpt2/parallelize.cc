// GPT-2 FSDP plan; see parallelize.h.
#include "models/gpt2/parallelize.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fsdpp {
namespace models {
namespace gpt2 {

absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyFsdp(
    Transformer* model, const FsdpPlanOptions& options) {
  if (model == nullptr) {
    return absl::InvalidArgumentError("gpt2::ApplyFsdp: null model");
  }
  if (model->config().family != ModelFamily::kGpt2) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt2::ApplyFsdp: model '", model->config().name,
                     "' is a ", ModelFamilyName(model->config().family),
                     " model (use that family's plan)"));
  }
  const std::vector<Module*> blocks(model->blocks().begin(),
                                    model->blocks().end());
  absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
      fsdp::ShardBlocksThenRoot(model, blocks, options);
  if (!units.ok()) return Annotate(units.status(), "gpt2::ApplyFsdp");
  return units;
}

}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp
