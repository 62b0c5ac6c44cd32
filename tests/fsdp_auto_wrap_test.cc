// AutoWrap on GPT-2 debug: the kind policy makes a unit of every block, the
// size policy wraps the smallest subtrees over the threshold, tied weights
// are grouped into one unit or left to the root; every variant trains (SGD,
// thread ranks over real Gloo) like the unsharded model. Also the plan
// helper ShardBlocksThenRoot (last block kept after forward) and errors.
#include <string>
#include <vector>

#include "fsdp/auto_wrap.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/testing/parity_testing.h"
#include "models/transformer.h"

namespace fsdpp {
namespace fsdp {
namespace {

using models::ConfigByName;
using models::Transformer;
using testing_util::TrainingResult;
using testing_util::TrainingRun;

std::unique_ptr<Transformer> Gpt2Debug() {
  return *Transformer::Create(*ConfigByName("gpt2_debug"));
}

// The plan as lists of module names.
std::vector<std::vector<std::string>> PlanNames(Module* root,
                                                const WrapPredicate& predicate,
                                                TiedParameterPolicy tied) {
  absl::StatusOr<std::vector<WrapGroup>> plan =
      PlanAutoWrap(root, predicate, tied);
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<std::vector<std::string>> out;
  if (!plan.ok()) return out;
  for (const WrapGroup& g : *plan) {
    std::vector<std::string> names;
    for (const auto& [name, m] : g.modules) names.push_back(name);
    out.push_back(names);
  }
  return out;
}

// Blocks, plus wte by name (to exercise the tie with lm_head).
bool BlocksAndWte(const WrapCandidate& c) {
  return c.module->kind() == "TransformerBlock" || c.name == "wte";
}

using Names = std::vector<std::vector<std::string>>;

TEST(AutoWrapTest, Plans) {
  auto model = Gpt2Debug();
  EXPECT_EQ(PlanNames(model.get(), WrapModuleKinds({"TransformerBlock"}),
                      TiedParameterPolicy::kGroup),
            (Names{{"h.0"}, {"h.1"}}));
  // Size policy: per block, the MLP (33,088 elements) reaches 20,000 and the
  // rest of a block (16,896) does not; the block stack's leftovers (33,792)
  // do. wte (32,768) does, and is tied to lm_head. Groups come in the
  // post-order of their last module (lm_head is the root's last child).
  EXPECT_EQ(PlanNames(model.get(), WrapMinParameters(20000),
                      TiedParameterPolicy::kGroup),
            (Names{{"h.0.mlp"}, {"h.1.mlp"}, {"h"}, {"wte", "lm_head"}}));
  EXPECT_EQ(PlanNames(model.get(), WrapMinParameters(20000),
                      TiedParameterPolicy::kLeaveToRoot),
            (Names{{"h.0.mlp"}, {"h.1.mlp"}, {"h"}}));
  EXPECT_EQ(PlanNames(model.get(), BlocksAndWte, TiedParameterPolicy::kGroup),
            (Names{{"h.0"}, {"h.1"}, {"wte", "lm_head"}}));
  EXPECT_EQ(
      PlanNames(model.get(), BlocksAndWte, TiedParameterPolicy::kLeaveToRoot),
      (Names{{"h.0"}, {"h.1"}}));
  // Both embeddings by kind: wpe is not tied and gets its own unit.
  EXPECT_EQ(PlanNames(model.get(), WrapModuleKinds({"Embedding"}),
                      TiedParameterPolicy::kLeaveToRoot),
            (Names{{"wpe"}}));
  // A wrapper around an already wrapped block would be an empty unit.
  EXPECT_EQ(
      PlanNames(model.get(),
                WrapModuleKinds({"TransformerBlock", "ActivationCheckpoint"}),
                TiedParameterPolicy::kGroup),
      (Names{{"h.0"}, {"h.1"}}));
  // Untied Llama: nothing to group.
  auto llama_config = *ConfigByName("llama_debug");
  llama_config.tied_embeddings = false;
  auto llama = *Transformer::Create(llama_config);
  EXPECT_EQ(PlanNames(llama.get(), WrapModuleKinds({"Embedding", "Linear"}),
                      TiedParameterPolicy::kGroup)
                .front(),
            (std::vector<std::string>{"tok_embeddings"}));
}

TEST(AutoWrapTest, ExclusiveParameters) {
  auto model = Gpt2Debug();
  EXPECT_TRUE(ExclusiveParameters(model.get(), model->token_embedding())
                  ->empty());  // wte.weight is read by lm_head too.
  EXPECT_EQ(ExclusiveParameters(model.get(), model->blocks()[0])->size(), 12u);
  EXPECT_EQ(ExclusiveParameters(model.get(), model.get())->size(),
            model->NamedParameters().size());
  auto other = Gpt2Debug();
  EXPECT_EQ(
      ExclusiveParameters(model.get(), other->final_norm()).status().code(),
      absl::StatusCode::kNotFound);
}

// A Setup that auto-wraps with `predicate` / `tied` and checks `check`.
testing_util::Setup AutoWrapSetup(
    WrapPredicate predicate, TiedParameterPolicy tied,
    std::function<void(Transformer*, const std::vector<FsdpUnit*>&)> check) {
  return [=](Transformer* model, DeviceMesh* mesh,
             uint64_t seed) -> absl::StatusOr<testing_util::TrainableModel> {
    AutoWrapOptions options;
    options.shard.mesh = mesh;
    options.tied = tied;
    absl::StatusOr<std::vector<FsdpUnit*>> units =
        AutoWrap(model, predicate, options);
    if (!units.ok()) return units.status();
    check(model, *units);
    absl::Status s = InitShardedWeights(model, seed);
    if (!s.ok()) return s;
    testing_util::TrainableModel out;
    for (ShardedParameter* sp : ShardedParameters(model)) {
      out.params.push_back({sp->name, &sp->master, &sp->grad});
    }
    return out;
  };
}

void ExpectParity(const TrainingResult& ref, const TrainingResult& got,
                  const std::string& what) {
  const testing_util::ParityReport r = testing_util::Compare(ref, got);
  EXPECT_LE(r.max_loss_rel, 1e-5) << what << ": " << r.ToString();
  EXPECT_LE(r.max_grad_rel, 1e-4) << what << ": " << r.ToString();
  EXPECT_LE(r.max_param_rel, 1e-5) << what << ": " << r.ToString();
}

TEST(AutoWrapTest, BlockPolicyMakesAUnitPerBlockWithParity) {
  TrainingRun run;
  const TrainingResult ref = testing_util::TrainReference(run);
  for (int world : {2, 3}) {
    const TrainingResult got = testing_util::Train(
        run, {{"dp", world}},
        AutoWrapSetup(
            WrapModuleKinds({"TransformerBlock"}), TiedParameterPolicy::kGroup,
            [](Transformer* model, const std::vector<FsdpUnit*>& units) {
              ASSERT_EQ(units.size(), model->blocks().size() + 1);
              for (size_t i = 0; i < model->blocks().size(); ++i) {
                EXPECT_EQ(UnitOf(model->blocks()[i]), units[i]);
              }
              EXPECT_EQ(UnitOf(model), units.back());
              EXPECT_TRUE(units.back()->is_root());
            }));
    ExpectParity(ref, got, "blocks W=" + std::to_string(world));
  }
}

TEST(AutoWrapTest, TiedWeightsGroupedOrLeftToRootWithParity) {
  TrainingRun run;
  const TrainingResult ref = testing_util::TrainReference(run);
  const TrainingResult grouped = testing_util::Train(
      run, {{"dp", 2}},
      AutoWrapSetup(BlocksAndWte, TiedParameterPolicy::kGroup,
                    [](Transformer* model, const std::vector<FsdpUnit*>&) {
                      FsdpUnit* tied = UnitOf(model->token_embedding());
                      ASSERT_NE(tied, nullptr);
                      // One unit hooked on both modules, owning wte.weight.
                      EXPECT_EQ(UnitOf(model->lm_head()), tied);
                      ASSERT_EQ(tied->parameters().size(), 1u);
                      EXPECT_EQ(tied->parameters()[0].parameter,
                                model->token_embedding()->weight());
                    }));
  ExpectParity(ref, grouped, "tied grouped");
  const TrainingResult to_root = testing_util::Train(
      run, {{"dp", 2}},
      AutoWrapSetup(BlocksAndWte, TiedParameterPolicy::kLeaveToRoot,
                    [](Transformer* model, const std::vector<FsdpUnit*>&) {
                      EXPECT_EQ(UnitOf(model->token_embedding()), nullptr);
                      EXPECT_EQ(UnitOf(model->lm_head()), nullptr);
                      bool in_root = false;
                      for (ShardedParameter& sp : UnitOf(model)->parameters()) {
                        if (sp.parameter == model->token_embedding()->weight())
                          in_root = true;
                      }
                      EXPECT_TRUE(in_root);
                    }));
  ExpectParity(ref, to_root, "tied left to root");
  // The size policy's mixed plan (a group, sub-block units, the stack).
  const TrainingResult by_size = testing_util::Train(
      run, {{"dp", 3}},
      AutoWrapSetup(WrapMinParameters(20000), TiedParameterPolicy::kGroup,
                    [](Transformer*, const std::vector<FsdpUnit*>& units) {
                      EXPECT_EQ(units.size(), 5u);
                    }));
  ExpectParity(ref, by_size, "size policy");
}

TEST(AutoWrapTest, ShardBlocksThenRootKeepsTheLastBlockAfterForward) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    auto model = Gpt2Debug();
    FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    std::vector<Module*> blocks(model->blocks().begin(), model->blocks().end());
    absl::StatusOr<std::vector<FsdpUnit*>> units =
        ShardBlocksThenRoot(model.get(), blocks, options);
    ASSERT_TRUE(units.ok()) << units.status();
    ASSERT_EQ(units->size(), 3u);
    ASSERT_TRUE(InitShardedWeights(model.get(), 7).ok());
    auto ids = *Tensor::FromInts({2, 4}, {1, 2, 3, 4, 5, 6, 7, 8});
    ASSERT_TRUE(model->ForwardLoss(ids, ids).ok());
    // After forward: block 0 resharded (meta), the last block and the root
    // still unsharded.
    for (auto& [name, p] : model->blocks()[0]->NamedParameters()) {
      EXPECT_TRUE(p->data.is_meta()) << name;
    }
    for (auto& [name, p] : model->blocks()[1]->NamedParameters()) {
      EXPECT_FALSE(p->data.is_meta()) << name;
    }
    EXPECT_FALSE(model->token_embedding()->weight()->data.is_meta());
    ASSERT_TRUE(model->Backward().ok());
    for (auto& [name, p] : model->blocks()[1]->NamedParameters()) {
      EXPECT_TRUE(p->data.is_meta()) << name;
    }
  });
}

TEST(AutoWrapTest, Errors) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    auto model = Gpt2Debug();
    AutoWrapOptions options;
    options.shard.mesh = &mesh;
    EXPECT_FALSE(
        PlanAutoWrap(nullptr, WrapMinParameters(1), TiedParameterPolicy::kGroup)
            .ok());
    EXPECT_FALSE(
        PlanAutoWrap(model.get(), WrapPredicate(), TiedParameterPolicy::kGroup)
            .ok());
    ASSERT_TRUE(FullyShard({model->blocks()[0]}, options.shard).ok());
    absl::StatusOr<std::vector<FsdpUnit*>> again =
        AutoWrap(model.get(), WrapModuleKinds({"TransformerBlock"}), options);
    ASSERT_FALSE(again.ok());
    EXPECT_NE(again.status().message().find("AutoWrap: sharding [h.0]"),
              absl::string_view::npos)
        << again.status();
    FsdpPlanOptions plan;
    plan.shard.mesh = &mesh;
    EXPECT_FALSE(ShardBlocksThenRoot(model.get(), {nullptr}, plan).ok());
  });
}

}  // namespace
}  // namespace fsdp
}  // namespace fsdpp
