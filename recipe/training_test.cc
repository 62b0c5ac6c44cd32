// The build and the step on thread ranks over real Gloo: FSDP on two ranks
// and a two-stage pipeline each train gpt2_debug to the single rank's loss,
// the optimizer step applies (and clips) on finite gradients, evaluation
// averages over the world, the pipeline describes itself, and a layout that
// does not validate or a mesh of other axes is refused. Every registered
// family has both plans.
#include "recipe/training.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "recipe/families.h"
#include "recipe/layout.h"
#include "recipe/step/step.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace recipe {
namespace {

constexpr int64_t kSeq = 16;

models::TransformerConfig Gpt2Debug() {
  return *models::ConfigByName("gpt2_debug");
}

// The same micro-batch m on every rank (data-parallel ranks would read
// different ones; these tests compare losses, not batches).
MicroBatchSource Source(int64_t rows, int64_t vocab) {
  return [rows, vocab](int64_t m) -> absl::StatusOr<MicroBatch> {
    std::vector<int64_t> ids, targets;
    for (int64_t i = 0; i < rows * kSeq; ++i) {
      ids.push_back((i * 7 + m * 13 + 1) % vocab);
      targets.push_back((i * 5 + m * 3 + 2) % vocab);
    }
    MicroBatch b;
    FSDPP_ASSIGN_OR_RETURN(b.ids, Tensor::FromInts({rows, kSeq}, ids));
    FSDPP_ASSIGN_OR_RETURN(b.targets, Tensor::FromInts({rows, kSeq}, targets));
    return b;
  };
}

Layout Base(int world) {
  Layout l;
  l.world = world;
  l.micro_batch = 2;
  l.seq_len = kSeq;
  l.grad_accumulation = 2;
  return l;
}

// Two steps of `layout`; rank 0's losses and the last step's norm.
struct Outcome {
  std::vector<double> losses;
  double grad_norm = 0;
  double eval = 0;
  std::vector<std::string> describe;
};

Outcome Train(const Layout& layout) {
  Outcome out;
  testing_util::RunOnMesh(layout.MeshAxes(), [&](int rank, DeviceMesh& mesh) {
    BuildOptions options;
    options.seed = 5;
    options.adamw.lr = 1e-3;
    absl::StatusOr<std::unique_ptr<Training>> t =
        Training::Build(Gpt2Debug(), layout, &mesh, options);
    ASSERT_TRUE(t.ok()) << t.status();
    const MicroBatchSource source =
        Source(layout.micro_batch, Gpt2Debug().vocab_size);
    for (int step = 0; step < 2; ++step) {
      absl::StatusOr<StepLoss> loss = (*t)->ForwardBackward(source);
      ASSERT_TRUE(loss.ok()) << loss.status();
      OptimizerStepOptions o;
      o.lr = 1e-3;
      o.grad_clip = 0.5;
      absl::StatusOr<OptimizerStepResult> opt = (*t)->OptimizerStep(o);
      ASSERT_TRUE(opt.ok()) << opt.status();
      EXPECT_TRUE(opt->applied);
      EXPECT_FALSE(opt->skipped);
      EXPECT_GT(opt->grad_norm, 0);
      if (rank == 0) {
        out.losses.push_back(loss->loss);
        out.grad_norm = opt->grad_norm;
      }
    }
    EXPECT_EQ((*t)->optimizer().step(), 2);
    absl::StatusOr<double> eval = (*t)->Evaluate(2, source);
    ASSERT_TRUE(eval.ok()) << eval.status();
    absl::StatusOr<std::string> table = (*t)->ReportTable({1.0, 1.0, 64});
    ASSERT_TRUE(table.ok()) << table.status();
    EXPECT_EQ(table->empty(), layout.pp == 1);
    if (rank == 0) {
      out.eval = *eval;
      out.describe = (*t)->Describe();
    }
  });
  return out;
}

TEST(TrainingTest, LayoutsTrainToTheSingleRanksLosses) {
  const Outcome one = Train(Base(1));
  ASSERT_EQ(one.losses.size(), 2u);
  EXPECT_GT(one.losses[0], one.losses[1]);
  EXPECT_TRUE(one.describe.empty());
  Layout fsdp = Base(2);
  fsdp.micro_batch = 2;  // each rank its own copy of the same rows
  const Outcome two = Train(fsdp);
  Layout pipeline = Base(2);
  pipeline.pp = 2;
  const Outcome pp = Train(pipeline);
  for (const Outcome* r : {&two, &pp}) {
    ASSERT_EQ(r->losses.size(), 2u);
    for (int s = 0; s < 2; ++s) {
      EXPECT_NEAR(r->losses[s], one.losses[s], 1e-5 * one.losses[s]) << s;
    }
    EXPECT_NEAR(r->grad_norm, one.grad_norm, 1e-4 * one.grad_norm);
    EXPECT_NEAR(r->eval, one.eval, 1e-5 * one.eval);
  }
  ASSERT_EQ(pp.describe.size(), 1u);
  EXPECT_TRUE(absl::StrContains(pp.describe[0], "pipeline: 1F1B over 2"))
      << pp.describe[0];
}

TEST(TrainingTest, RefusesBadLayoutsAndOtherMeshes) {
  testing_util::RunOnMesh({{"shard", 2}}, [](int, DeviceMesh& mesh) {
    Layout bad = Base(2);
    bad.tp = 3;
    EXPECT_EQ(Training::Build(Gpt2Debug(), bad, &mesh, {}).status().code(),
              absl::StatusCode::kInvalidArgument);
    Layout four = Base(4);
    absl::Status s = Training::Build(Gpt2Debug(), four, &mesh, {}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(s.message(), "is not the layout's")) << s;
  });
}

TEST(FamiliesTest, EveryFamilyHasBothPlans) {
  for (models::ModelFamily family :
       {models::ModelFamily::kGpt2, models::ModelFamily::kLlama}) {
    absl::StatusOr<const FamilyPlans*> plans = PlansFor(family);
    ASSERT_TRUE(plans.ok()) << plans.status();
    EXPECT_EQ((*plans)->name, models::ModelFamilyName(family));
    EXPECT_TRUE((*plans)->apply_fsdp);
    EXPECT_TRUE((*plans)->apply_tensor_parallel);
  }
  EXPECT_EQ(AllFamilyPlans().size(), 2u);
  EXPECT_EQ(PlansFor(static_cast<models::ModelFamily>(99)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace recipe
}  // namespace fsdpp
