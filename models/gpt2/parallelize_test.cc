// The GPT-2 FSDP plan: one unit per block plus the root (wte, wpe, ln_f and
// the tied head), the last block kept after forward, and parity with the
// unsharded model on W = 2 (SGD, thread ranks over real Gloo).
#include "models/gpt2/parallelize.h"

#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/testing/parity_testing.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {
namespace gpt2 {
namespace {

using testing_util::TrainingResult;
using testing_util::TrainingRun;

constexpr char kConfig[] = "gpt2_debug";

TEST(Gpt2PlanTest, UnitsAreTheBlocksThenTheRoot) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    auto model = *Transformer::Create(*ConfigByName(kConfig));
    FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
        ApplyFsdp(model.get(), options);
    ASSERT_TRUE(units.ok()) << units.status();
    ASSERT_EQ(units->size(), model->blocks().size() + 1);
    for (size_t i = 0; i < model->blocks().size(); ++i) {
      EXPECT_EQ(fsdp::UnitOf(model->blocks()[i]), (*units)[i]);
      EXPECT_EQ((*units)[i]->parameters().size(), 12u);
    }
    fsdp::FsdpUnit* root = units->back();
    EXPECT_TRUE(root->is_root());
    std::set<std::string> root_params;
    for (fsdp::ShardedParameter& sp : root->parameters()) {
      root_params.insert(sp.name);
    }
    EXPECT_EQ(root_params, (std::set<std::string>{"wte.weight", "wpe.weight",
                                                  "ln_f.weight", "ln_f.bias"}));
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

TEST(Gpt2PlanTest, ParityOnTwoRanks) {
  TrainingRun run;
  run.config = kConfig;
  const TrainingResult ref = testing_util::TrainReference(run);
  FsdpPlanOptions options;
  const TrainingResult got = testing_util::Train(
      run, {{"dp", 2}}, testing_util::FsdpPlanSetup(ApplyFsdp, options));
  const testing_util::ParityReport r = testing_util::Compare(ref, got);
  EXPECT_LE(r.max_loss_rel, 1e-5) << r.ToString();
  EXPECT_LE(r.max_grad_rel, 1e-4) << r.ToString();
  EXPECT_LE(r.max_param_rel, 1e-5) << r.ToString();
}

TEST(Gpt2PlanTest, RejectsOtherFamilies) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    auto llama = *Transformer::Create(*ConfigByName("llama_debug"));
    FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
        ApplyFsdp(llama.get(), options);
    ASSERT_FALSE(units.ok());
    EXPECT_NE(units.status().message().find("is a llama model"),
              absl::string_view::npos)
        << units.status();
    EXPECT_FALSE(ApplyFsdp(nullptr, options).ok());
  });
}

}  // namespace
}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp
