// The GPT-2 FSDP plan: one unit per block plus the root (wte, wpe, ln_f and
// the tied head), the last block kept after forward, and parity with the
// unsharded model on W = 2 (SGD, thread ranks over real Gloo); the checks are
// the ones every family's plan passes (models/testing/plan_checks.h).
#include "models/gpt2/parallelize.h"

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "models/testing/plan_checks.h"

namespace fsdpp {
namespace models {
namespace gpt2 {
namespace {

testing_util::PlanExpectation Gpt2Plan() {
  testing_util::PlanExpectation e;
  e.plan = ApplyFsdp;
  e.config = "gpt2_debug";
  e.block_parameters = 12;
  e.root_parameters = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"};
  e.other_family_config = "llama_debug";
  e.other_family_name = "llama";
  return e;
}

TEST(Gpt2PlanTest, UnitsAreTheBlocksThenTheRoot) {
  testing_util::ExpectBlocksThenRoot(Gpt2Plan());
}

TEST(Gpt2PlanTest, ParityOnTwoRanks) {
  testing_util::ExpectParityOnTwoRanks(Gpt2Plan());
}

TEST(Gpt2PlanTest, RejectsOtherFamilies) {
  testing_util::ExpectRejectsOtherFamilies(Gpt2Plan());
}

testing_util::TensorParallelPlanWith TensorParallelWith() {
  return testing_util::TensorParallelWith<TensorParallelOptions>(
      ApplyTensorParallel);
}

TEST(Gpt2PlanTest, TensorParallelParity) {
  testing_util::ExpectTensorParallelParity("gpt2_debug", TensorParallelWith(),
                                           ApplyFsdp);
}

// FSDP on the dp axis of a [dp, tp] mesh: the masters are 2-D DTensors
// (the tp split first, then FSDP's rows of each piece; GPT-2's c_attn as its
// [3, C, C] view split on dim 1 by both) and every all-gather runs over the
// 2 dp ranks only.
TEST(Gpt2PlanTest, FsdpOnTheDpAxisOfATwoDimensionalMesh) {
  testing_util::RunOnMesh({{"dp", 2}, {"tp", 2}}, [](int, DeviceMesh& mesh) {
    auto model = *Transformer::Create(*ConfigByName("gpt2_debug"));
    ASSERT_TRUE(ApplyTensorParallel(model.get(), &mesh).ok());
    FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    options.shard.tp_axis = "tp";
    absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
        ApplyFsdp(model.get(), options);
    ASSERT_TRUE(units.ok()) << units.status();
    ASSERT_TRUE(fsdp::InitShardedWeights(model.get(), 3).ok());
    std::map<std::string, std::string> placed;
    for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(model.get())) {
      placed[sp->name] =
          absl::StrCat(PlacementsToString(sp->master.placements()), " ",
                       ShapeToString(sp->master.shape()));
      EXPECT_EQ(sp->master.mesh()->axes()[0].name, "tp") << sp->name;
    }
    EXPECT_EQ(placed["h.0.attn.c_attn.weight"], "[S(1), S(1)] [3, 64, 64]");
    EXPECT_EQ(placed["h.0.attn.c_proj.weight"], "[S(1), S(0)] [64, 64]");
    EXPECT_EQ(placed["h.0.mlp.fc.weight"], "[S(0), S(0)] [256, 64]");
    EXPECT_EQ(placed["wte.weight"], "[S(0), S(0)] [512, 64]");
    EXPECT_EQ(placed["h.0.ln_1.weight"], "[R, S(0)] [64]");
    const Tensor ids = *Tensor::FromInts({2, 8}, std::vector<int64_t>(16, 7));
    ASSERT_TRUE(model->ForwardLoss(ids, ids).ok());
    ASSERT_TRUE(model->Backward().ok());
    for (fsdp::FsdpUnit* u : *units) {
      EXPECT_EQ(u->stats().forward_all_gathers,
                (std::map<int, int64_t>{{2, 1}}))
          << u->name();
    }
  });
}

TEST(Gpt2PlanTest, TensorParallelRefusesWhatDoesNotDivide) {
  testing_util::ExpectTensorParallelRefusals("gpt2_debug", "llama_debug",
                                             TensorParallelWith());
}

}  // namespace
}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp
