// The families' plans; see families.h.
#include "recipe/families.h"

#include "absl/strings/str_cat.h"
#include "models/gpt2/parallelize.h"
#include "models/llama/parallelize.h"

namespace fsdpp {
namespace recipe {

const std::vector<FamilyPlans>& AllFamilyPlans() {
  static const std::vector<FamilyPlans>* const plans =
      new std::vector<FamilyPlans>{
          {"gpt2", models::gpt2::ApplyFsdp, models::gpt2::ApplyTensorParallel},
          {"llama", models::llama::ApplyFsdp,
           models::llama::ApplyTensorParallel},
      };
  return *plans;
}

absl::StatusOr<const FamilyPlans*> PlansFor(models::ModelFamily family) {
  const std::string name = models::ModelFamilyName(family);
  for (const FamilyPlans& plans : AllFamilyPlans()) {
    if (plans.name == name) return &plans;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("recipe: no parallelize plans for model family \"", name,
                   "\" (recipe/families.cc lists them)"));
}

}  // namespace recipe
}  // namespace fsdpp
