// Llama FSDP plan; see parallelize.h.
#include "models/llama/parallelize.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fsdpp {
namespace models {
namespace llama {

absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyFsdp(
    Transformer* model, const FsdpPlanOptions& options) {
  if (model == nullptr) {
    return absl::InvalidArgumentError("llama::ApplyFsdp: null model");
  }
  if (model->config().family != ModelFamily::kLlama) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama::ApplyFsdp: model '", model->config().name,
                     "' is a ", ModelFamilyName(model->config().family),
                     " model (use that family's plan)"));
  }
  const std::vector<Module*> blocks(model->blocks().begin(),
                                    model->blocks().end());
  absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
      fsdp::ShardBlocksThenRoot(model, blocks, options);
  if (!units.ok()) return Annotate(units.status(), "llama::ApplyFsdp");
  return units;
}

}  // namespace llama
}  // namespace models
}  // namespace fsdpp
