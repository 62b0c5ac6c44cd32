// The checks every model family's FSDP plan must pass, shared by the plan
// tests of models/gpt2 and models/llama: the units are the blocks in order
// then the root (with the family's root parameters), blocks other than the
// last are resharded after forward, training on W = 2 matches the unsharded
// model, and a model of another family is refused by name.
#ifndef FSDPP_MODELS_TESTING_PLAN_CHECKS_H_
#define FSDPP_MODELS_TESTING_PLAN_CHECKS_H_

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/testing/parity_testing.h"
#include "models/transformer.h"

namespace fsdpp {
namespace testing_util {

// What a family's plan is checked against.
struct PlanExpectation {
  testing_util::FsdpPlan plan;  // The family's ApplyFsdp.
  std::string config;           // A debug config of the family.
  size_t block_parameters = 0;  // Parameters in each block's unit.
  std::set<std::string> root_parameters;
  std::string other_family_config;  // A config the plan must refuse...
  std::string other_family_name;    // ...saying "is a <name> model".
};

// Units: the blocks in order then the root with exactly the expected
// parameters; after a forward, the first block is resharded (meta) and the
// last block kept for backward.
inline void ExpectBlocksThenRoot(const PlanExpectation& e) {
  RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    auto model = *models::Transformer::Create(*models::ConfigByName(e.config));
    fsdp::FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
        e.plan(model.get(), options);
    ASSERT_TRUE(units.ok()) << units.status();
    ASSERT_EQ(units->size(), model->blocks().size() + 1);
    for (size_t i = 0; i < model->blocks().size(); ++i) {
      EXPECT_EQ(fsdp::UnitOf(model->blocks()[i]), (*units)[i]);
      EXPECT_EQ((*units)[i]->parameters().size(), e.block_parameters);
    }
    fsdp::FsdpUnit* root = units->back();
    EXPECT_TRUE(root->is_root());
    std::set<std::string> root_params;
    for (fsdp::ShardedParameter& sp : root->parameters()) {
      root_params.insert(sp.name);
    }
    EXPECT_EQ(root_params, e.root_parameters);
    ASSERT_TRUE(fsdp::InitShardedWeights(model.get(), 1).ok());
    auto ids = *Tensor::FromInts({2, 4}, {1, 2, 3, 4, 5, 6, 7, 8});
    ASSERT_TRUE(model->ForwardLoss(ids, ids).ok());
    // ZeRO-3 blocks, except the last one (backward needs it first).
    for (auto& [name, p] : model->blocks().front()->NamedParameters()) {
      EXPECT_TRUE(p->data.is_meta()) << name;
    }
    for (auto& [name, p] : model->blocks().back()->NamedParameters()) {
      EXPECT_FALSE(p->data.is_meta()) << name;
    }
    ASSERT_TRUE(model->Backward().ok());
  });
}

// SGD training on W = 2 under the plan matches the unsharded model.
inline void ExpectParityOnTwoRanks(const PlanExpectation& e) {
  TrainingRun run;
  run.config = e.config;
  const TrainingResult ref = TrainReference(run);
  const TrainingResult got =
      Train(run, {{"dp", 2}}, FsdpPlanSetup(e.plan, fsdp::FsdpPlanOptions{}));
  const ParityReport r = Compare(ref, got);
  EXPECT_LE(r.max_loss_rel, 1e-5) << r.ToString();
  EXPECT_LE(r.max_grad_rel, 1e-4) << r.ToString();
  EXPECT_LE(r.max_param_rel, 1e-5) << r.ToString();
}

// A model of another family, and a null model, are refused.
inline void ExpectRejectsOtherFamilies(const PlanExpectation& e) {
  RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    auto other = *models::Transformer::Create(
        *models::ConfigByName(e.other_family_config));
    fsdp::FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
        e.plan(other.get(), options);
    ASSERT_FALSE(units.ok());
    EXPECT_NE(units.status().message().find(
                  absl::StrCat("is a ", e.other_family_name, " model")),
              absl::string_view::npos)
        << units.status();
    EXPECT_FALSE(e.plan(nullptr, options).ok());
  });
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_MODELS_TESTING_PLAN_CHECKS_H_
