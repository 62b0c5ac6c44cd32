// GPT-2 FSDP plan; see parallelize.h.
#include "models/gpt2/parallelize.h"

#include "models/parallelize/block_plan.h"

namespace fsdpp {
namespace models {
namespace gpt2 {

absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyFsdp(
    Transformer* model, const FsdpPlanOptions& options) {
  return ApplyBlockPlan(model, ModelFamily::kGpt2, "gpt2::ApplyFsdp", options);
}

absl::Status ApplyTensorParallel(Transformer* model, DeviceMesh* mesh,
                                 const TensorParallelOptions& options) {
  return ApplyTensorParallelPlan(model, ModelFamily::kGpt2,
                                 "gpt2::ApplyTensorParallel", mesh, options);
}

}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp
