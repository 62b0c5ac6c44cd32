// Llama FSDP plan; see parallelize.h.
#include "models/llama/parallelize.h"

#include "models/parallelize/block_plan.h"

namespace fsdpp {
namespace models {
namespace llama {

absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyFsdp(
    Transformer* model, const FsdpPlanOptions& options) {
  return ApplyBlockPlan(model, ModelFamily::kLlama, "llama::ApplyFsdp",
                        options);
}

absl::Status ApplyTensorParallel(Transformer* model, DeviceMesh* mesh,
                                 const TensorParallelOptions& options) {
  return ApplyTensorParallelPlan(model, ModelFamily::kLlama,
                                 "llama::ApplyTensorParallel", mesh, options);
}

}  // namespace llama
}  // namespace models
}  // namespace fsdpp
