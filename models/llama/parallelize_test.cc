// The Llama FSDP plan: one unit per block plus the root (tok_embeddings,
// norm and the tied output, or the untied one), the last block kept after
// forward, and parity with the unsharded model on W = 2 (SGD, thread ranks over
// real Gloo); the shared checks are models/testing/plan_checks.h.
#include "models/llama/parallelize.h"

#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/testing/plan_checks.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {
namespace llama {
namespace {

constexpr char kConfig[] = "llama_debug";

testing_util::PlanExpectation LlamaPlan() {
  testing_util::PlanExpectation e;
  e.plan = ApplyFsdp;
  e.config = kConfig;
  e.block_parameters = 9;
  e.root_parameters = {"tok_embeddings.weight", "norm.weight"};
  e.other_family_config = "gpt2_debug";
  e.other_family_name = "gpt2";
  return e;
}

TEST(LlamaPlanTest, UnitsAreTheBlocksThenTheRoot) {
  testing_util::ExpectBlocksThenRoot(LlamaPlan());
}

TEST(LlamaPlanTest, UntiedHeadStaysInTheRoot) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    TransformerConfig config = *ConfigByName(kConfig);
    config.tied_embeddings = false;
    auto model = *Transformer::Create(config);
    FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
        ApplyFsdp(model.get(), options);
    ASSERT_TRUE(units.ok()) << units.status();
    std::set<std::string> root_params;
    for (fsdp::ShardedParameter& sp : units->back()->parameters()) {
      root_params.insert(sp.name);
    }
    EXPECT_EQ(root_params,
              (std::set<std::string>{"tok_embeddings.weight", "norm.weight",
                                     "output.weight"}));
  });
}

TEST(LlamaPlanTest, ParityOnTwoRanks) {
  testing_util::ExpectParityOnTwoRanks(LlamaPlan());
}

TEST(LlamaPlanTest, RejectsOtherFamilies) {
  testing_util::ExpectRejectsOtherFamilies(LlamaPlan());
}

}  // namespace
}  // namespace llama
}  // namespace models
}  // namespace fsdpp
