// Replicate (DDP) against the unsharded model on W = 2, 3 (thread ranks over
// real Gloo): losses, gradients and SGD-trained parameters match with one
// flat bucket and with a bucket per block, with activation checkpointing,
// with gradient accumulation with and without sync, and on a 2-D mesh; tied
// weights go to the root bucket; bad input fails with clear errors.
#include <string>
#include <vector>

#include "fsdp/fully_shard.h"
#include "fsdp/replicate.h"
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

void ExpectParity(const TrainingResult& ref, const TrainingResult& got,
                  const std::string& what) {
  const testing_util::ParityReport r = testing_util::Compare(ref, got);
  EXPECT_LE(r.max_loss_rel, 1e-5) << what << ": " << r.ToString();
  EXPECT_LE(r.max_grad_rel, 1e-4) << what << ": " << r.ToString();
  EXPECT_LE(r.max_param_rel, 1e-5) << what << ": " << r.ToString();
}

TEST(ReplicateTest, Gpt2ParityFlatAndPerBlockBuckets) {
  TrainingRun run;
  const TrainingResult ref = testing_util::TrainReference(run);
  for (int world : {2, 3}) {
    for (bool per_block : {false, true}) {
      ExpectParity(ref,
                   testing_util::Train(run, {{"dp", world}},
                                       testing_util::ReplicateSetup(per_block)),
                   "W=" + std::to_string(world) +
                       (per_block ? " bucket per block" : " one bucket"));
    }
  }
}

TEST(ReplicateTest, LlamaParityCheckpointingMicroBatchesAnd2dMesh) {
  TrainingRun run;
  run.config = "llama_debug";
  const TrainingResult ref = testing_util::TrainReference(run);
  models::TransformerOptions checkpointed;
  checkpointed.activation_checkpointing = nn::CheckpointPolicy::Full();
  ExpectParity(
      ref,
      testing_util::Train(run, {{"dp", 3}}, testing_util::ReplicateSetup(true),
                          checkpointed),
      "activation checkpointing");
  ExpectParity(ref,
               testing_util::Train(run, {{"a", 2}, {"b", 2}},
                                   testing_util::ReplicateSetup(true)),
               "2x2 mesh");
  for (bool sync : {true, false}) {
    TrainingRun micro = run;
    micro.micro_batches = 2;
    micro.sync_every_micro_batch = sync;
    ExpectParity(ref,
                 testing_util::Train(micro, {{"dp", 2}},
                                     testing_util::ReplicateSetup(true)),
                 sync ? "2 micro-batches, sync" : "2 micro-batches, no sync");
  }
}

TEST(ReplicateTest, BucketOfAModuleThatRanNoBackwardIsReducedAtTheEnd) {
  // Without activation checkpointing the blocks' ActivationCheckpoint
  // wrappers never run: their buckets go with the root's.
  TrainingRun run;
  const TrainingResult ref = testing_util::TrainReference(run);
  const TrainingResult got = testing_util::Train(
      run, {{"dp", 2}},
      [](Transformer* model, DeviceMesh* mesh,
         uint64_t seed) -> absl::StatusOr<testing_util::TrainableModel> {
        absl::Status s = model->ToEmpty(Device::Cpu());
        if (s.ok()) s = model->InitWeights(seed);
        if (!s.ok()) return s;
        ReplicateOptions options;
        options.mesh = mesh;
        for (auto& [name, m] : model->NamedModules()) {
          if (m->kind() == "ActivationCheckpoint") {
            options.bucket_modules.push_back(m);
          }
        }
        EXPECT_EQ(options.bucket_modules.size(), 2u);
        absl::StatusOr<ReplicatedModule*> r = Replicate(model, options);
        if (!r.ok()) return r.status();
        testing_util::TrainableModel out;
        for (ReplicatedParameter& p : (*r)->parameters()) {
          out.params.push_back({p.name, &p.param, &p.grad});
        }
        return out;
      });
  ExpectParity(ref, got, "wrapper buckets");
}

TEST(ReplicateTest, BucketsAndTiedWeights) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    auto model = *Transformer::Create(*ConfigByName("gpt2_debug"));
    ASSERT_TRUE(model->ToEmpty(Device::Cpu()).ok());
    ASSERT_TRUE(model->InitWeights(1).ok());
    ReplicateOptions options;
    options.mesh = &mesh;
    // wte is listed, but lm_head reads its weight: it goes to the root.
    options.bucket_modules = {model->token_embedding(), model->blocks()[0],
                              model->blocks()[1]};
    absl::StatusOr<ReplicatedModule*> r = Replicate(model.get(), options);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<std::vector<std::string>> buckets = (*r)->BucketNames();
    ASSERT_EQ(buckets.size(), 4u);
    EXPECT_TRUE(buckets[0].empty());
    ASSERT_EQ(buckets[1].size(), 12u);
    EXPECT_EQ(buckets[1].front(), "h.0.ln_1.weight");
    EXPECT_EQ(buckets[2].front(), "h.1.ln_1.weight");
    EXPECT_EQ(buckets[3],
              (std::vector<std::string>{"wte.weight", "wpe.weight",
                                        "ln_f.weight", "ln_f.bias"}));
    // Parameters and gradients are all-Replicate views.
    for (ReplicatedParameter& p : (*r)->parameters()) {
      EXPECT_TRUE(p.param.local().SharesStorageWith(p.parameter->data));
      EXPECT_TRUE(p.grad.local().SharesStorageWith(p.parameter->grad));
      EXPECT_EQ(p.param.placements(),
                std::vector<Placement>{Placement::Replicate()});
    }
    // Gradients must stay the views' storage.
    ASSERT_TRUE(model->ZeroGrad(/*set_to_none=*/true).ok());
    auto ids = *Tensor::FromInts({1, 4}, {1, 2, 3, 4});
    ASSERT_TRUE(model->ForwardLoss(ids, ids).ok());
    absl::Status dropped = model->Backward();
    ASSERT_FALSE(dropped.ok());
    EXPECT_NE(dropped.message().find("was replaced or dropped"),
              absl::string_view::npos)
        << dropped;
    // Replicating twice would double the hooks.
    absl::StatusOr<ReplicatedModule*> again = Replicate(model.get(), options);
    ASSERT_FALSE(again.ok());
    EXPECT_NE(again.status().message().find("already replicated"),
              absl::string_view::npos);
  });
}

TEST(ReplicateTest, BroadcastsRankZerosParameters) {
  testing_util::RunOnMesh({{"dp", 3}}, [](int rank, DeviceMesh& mesh) {
    auto model = *Transformer::Create(*ConfigByName("gpt2_debug"));
    ASSERT_TRUE(model->ToEmpty(Device::Cpu()).ok());
    ASSERT_TRUE(model->InitWeights(100 + rank).ok());  // Different per rank.
    ReplicateOptions options;
    options.mesh = &mesh;
    ASSERT_TRUE(Replicate(model.get(), options).ok());
    auto expected = *Transformer::Create(*ConfigByName("gpt2_debug"));
    ASSERT_TRUE(expected->ToEmpty(Device::Cpu()).ok());
    ASSERT_TRUE(expected->InitWeights(100).ok());
    const auto got = model->NamedParameters();
    const auto want = expected->NamedParameters();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(*got[i].second->data.ToFloats(),
                *want[i].second->data.ToFloats())
          << got[i].first;
    }
  });
}

TEST(ReplicateTest, Errors) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    auto meta = *Transformer::Create(*ConfigByName("gpt2_debug"));
    ReplicateOptions options;
    options.mesh = &mesh;
    absl::StatusOr<ReplicatedModule*> r = Replicate(meta.get(), options);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("'wte.weight' is not materialised"),
              absl::string_view::npos)
        << r.status();
    // Sharded parameters are meta too.
    FullyShardOptions shard;
    shard.mesh = &mesh;
    ASSERT_TRUE(FullyShard({meta.get()}, shard).ok());
    EXPECT_FALSE(Replicate(meta.get(), options).ok());

    auto model = *Transformer::Create(*ConfigByName("gpt2_debug"));
    ASSERT_TRUE(model->ToEmpty(Device::Cpu()).ok());
    ReplicateOptions no_mesh;
    EXPECT_FALSE(Replicate(model.get(), no_mesh).ok());
    ReplicateOptions int_reduce = options;
    int_reduce.reduce_dtype = DType::kI32;
    EXPECT_FALSE(Replicate(model.get(), int_reduce).ok());
    auto other = *Transformer::Create(*ConfigByName("gpt2_debug"));
    ReplicateOptions outside = options;
    outside.bucket_modules = {other->final_norm()};
    r = Replicate(model.get(), outside);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("is not inside the root"),
              absl::string_view::npos)
        << r.status();
    ReplicateOptions root_bucket = options;
    root_bucket.bucket_modules = {model.get()};
    EXPECT_FALSE(Replicate(model.get(), root_bucket).ok());
  });
}

}  // namespace
}  // namespace fsdp
}  // namespace fsdpp
