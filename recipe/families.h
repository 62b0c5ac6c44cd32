// The model families' parallelize plans, by family: the one place that names
// the families (models/gpt2, models/llama). The build (recipe/training.h)
// looks a model's plans up here; a new family adds its entry to the table
// in families.cc, and nothing else in recipe/, plan/ or trainer/ changes.
#ifndef FSDPP_RECIPE_FAMILIES_H_
#define FSDPP_RECIPE_FAMILIES_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/parallelize/tensor_parallel_plan.h"
#include "models/transformer.h"

namespace fsdpp {
namespace recipe {

struct FamilyPlans {
  std::string name;
  // The FSDP plan (models/<family>/parallelize.h ApplyFsdp): the units,
  // root last.
  std::function<absl::StatusOr<std::vector<fsdp::FsdpUnit*>>(
      models::Transformer*, const fsdp::FsdpPlanOptions&)>
      apply_fsdp;
  // The tensor-parallel plan on options.tp_axis of the mesh (apply it
  // before the FSDP plan).
  std::function<absl::Status(models::Transformer*, DeviceMesh*,
                             const models::TensorParallelPlanOptions&)>
      apply_tensor_parallel;
};

// The plans of `family`; InvalidArgument for a family without an entry.
absl::StatusOr<const FamilyPlans*> PlansFor(models::ModelFamily family);

// Every family's plans, in the table's order.
const std::vector<FamilyPlans>& AllFamilyPlans();

}  // namespace recipe
}  // namespace fsdpp

#endif  // FSDPP_RECIPE_FAMILIES_H_
