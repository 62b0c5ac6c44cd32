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

testing_util::TensorParallelPlanWith TensorParallelWith() {
  return testing_util::TensorParallelWith<TensorParallelOptions>(
      ApplyTensorParallel);
}

TEST(LlamaPlanTest, TensorParallelParity) {
  testing_util::ExpectTensorParallelParity("llama_debug", TensorParallelWith(),
                                           ApplyFsdp);
}

TEST(LlamaPlanTest, TensorParallelRefusesWhatDoesNotDivide) {
  testing_util::ExpectTensorParallelRefusals("llama_debug", "gpt2_debug",
                                             TensorParallelWith());
}

// GQA: 2 kv heads over tp 4 keep each kv head whole on the two ranks whose
// query heads share it; 3 kv heads over tp 2 neither divide nor are divided.
TEST(LlamaPlanTest, KvHeadsAreSplitOrKeptWhole) {
  testing_util::RunOnMesh({{"tp", 4}}, [](int, DeviceMesh& mesh) {
    auto model = *Transformer::Create(*ConfigByName(kConfig));
    ASSERT_TRUE(ApplyTensorParallel(model.get(), &mesh).ok());
    for (auto& [name, p] : model->NamedParameters()) {
      if (name == "layers.0.attention.wk.weight") {
        EXPECT_FALSE(p->has_piece());
      }
      if (name == "layers.0.attention.wq.weight") {
        EXPECT_EQ(p->LocalShape(), (Shape{16, 64}));
      }
    }
  });
  testing_util::RunOnMesh({{"tp", 2}}, [](int, DeviceMesh& mesh) {
    TransformerConfig config = *ConfigByName(kConfig);
    config.n_heads = 6;
    config.n_kv_heads = 3;
    config.dim = 48;
    auto model = *Transformer::Create(config);
    const absl::Status s = ApplyTensorParallel(model.get(), &mesh);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("module 'layers.0.attention': n_kv_heads (3) "
                               "must be divisible by the tp size 2"),
              std::string::npos)
        << s;
    for (auto& [name, p] : model->NamedParameters()) {
      EXPECT_FALSE(p->has_piece()) << name;
    }
  });
}

}  // namespace
}  // namespace llama
}  // namespace models
}  // namespace fsdpp
