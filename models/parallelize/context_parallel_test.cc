// Context parallelism in a whole model (models::TransformerOptions::
// context_parallel, parallel::RingContextParallel and
// UlyssesContextParallel) on thread ranks over real Gloo, against the model
// on the whole rows in one process.
#include "parallel/context_parallel.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/transformer.h"
#include "nn/attention.h"
#include "nn/checkpoint_wrapper.h"
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace models {
namespace {

using parallel::ContextLayout;
using parallel::RingContextParallel;
using parallel::UlyssesContextParallel;
using testing_util::AllClose;
using testing_util::PackedDocumentIds;
using testing_util::RunOnMesh;
using testing_util::Values;

// A whole model on each cp rank's columns (TransformerOptions::
// context_parallel: whole rows of ids and targets in, this rank's share
// computed) equals the model on the whole rows: the mean of the ranks'
// losses is the whole loss, and the parameter gradients averaged over the
// ranks (what FSDP over dp x cp does) are the whole gradients; GPT-2 (wpe at
// the global positions) and Llama (RoPE), cp 2 and 3, with and without
// document masks, with no and selective activation checkpointing; the
// all-to-all style at cp 2 likewise.
TEST(ContextParallelModelTest, ModelOnItsColumnsEqualsTheWholeModel) {
  const int64_t b = 2, t = 48;
  const Tensor ids = PackedDocumentIds(b, t);
  std::vector<int64_t> target_ids(b * t);
  for (int64_t i = 0; i < b * t; ++i) target_ids[i] = (i * 37 + 11) % 500;
  const Tensor targets = *Tensor::FromInts({b, t}, target_ids, DType::kI32);
  for (const char* name : {"gpt2_debug", "llama_debug"}) {
    for (const auto& [style, cp] : {std::pair{"ring", 2}, std::pair{"ring", 3},
                                    std::pair{"alltoall", 2}}) {
      for (bool documents : {false, true}) {
        for (const nn::CheckpointPolicy& policy :
             {nn::CheckpointPolicy::None(),
              nn::CheckpointPolicy::Selective()}) {
          SCOPED_TRACE(::testing::Message()
                       << name << " " << style << " cp " << cp << " documents "
                       << documents << " " << policy.ToString());
          const TransformerConfig config = *ConfigByName(name);
          TransformerOptions options;
          options.document_eot_id = documents ? 0 : -1;
          options.activation_checkpointing = policy;
          auto make = [&](const TransformerOptions& o) {
            auto model = *Transformer::Create(config, o);
            EXPECT_TRUE(model->ToEmpty(Device::Cpu()).ok());
            EXPECT_TRUE(model->InitWeights(5).ok());
            return model;
          };
          auto whole = make(options);
          const float whole_loss = *whole->ForwardLoss(ids, targets);
          ASSERT_TRUE(whole->Backward().ok());
          const ContextLayout layout = *ContextLayout::Create(cp, t);
          RunOnMesh({{"cp", cp}}, [&](int rank, DeviceMesh& mesh) {
            SCOPED_TRACE(::testing::Message() << "rank " << rank);
            ProcessGroup* group = *mesh.Group("cp");
            std::unique_ptr<nn::ContextParallel> split;
            if (std::string(style) == "ring") {
              split = std::make_unique<RingContextParallel>(group, layout);
            } else {
              split = std::make_unique<UlyssesContextParallel>(group, layout);
            }
            TransformerOptions split_options = options;
            split_options.context_parallel = split.get();
            auto model = make(split_options);
            absl::StatusOr<float> loss = model->ForwardLoss(ids, targets);
            ASSERT_TRUE(loss.ok()) << loss.status();
            absl::Status back = model->Backward();
            ASSERT_TRUE(back.ok()) << back;
            Tensor sum = *Tensor::FromFloats({1}, {*loss});
            ASSERT_TRUE((*group->AllReduce(AsBuffer(sum), ReduceOp::kSum))
                            ->Wait(absl::Minutes(1))
                            .ok());
            EXPECT_NEAR(Values(sum)[0] / cp, whole_loss, 1e-6);
            const auto whole_params = whole->NamedParameters();
            const auto split_params = model->NamedParameters();
            ASSERT_EQ(whole_params.size(), split_params.size());
            for (size_t p = 0; p < split_params.size(); ++p) {
              Tensor grad = split_params[p].second->grad;
              ASSERT_TRUE((*group->AllReduce(AsBuffer(grad), ReduceOp::kSum))
                              ->Wait(absl::Minutes(1))
                              .ok());
              ASSERT_TRUE(Scale(grad, 1.0f / cp, &grad).ok());
              EXPECT_TRUE(AllClose(Values(grad),
                                   Values(whole_params[p].second->grad), 1e-5,
                                   1e-6))
                  << split_params[p].first;
            }
          });
        }
      }
    }
  }
}

// Whole rows of another length are refused, naming the split's.
TEST(ContextParallelModelTest, RefusesRowsOfAnotherLength) {
  const TransformerConfig config = *ConfigByName("llama_debug");
  const ContextLayout layout = *ContextLayout::Create(2, 16);
  RunOnMesh({{"cp", 2}}, [&](int, DeviceMesh& mesh) {
    RingContextParallel split(*mesh.Group("cp"), layout);
    TransformerOptions options;
    options.context_parallel = &split;
    auto model = *Transformer::Create(config, options);
    ASSERT_TRUE(model->ToEmpty(Device::Cpu()).ok());
    const absl::StatusOr<float> loss =
        model->ForwardLoss(PackedDocumentIds(1, 12), PackedDocumentIds(1, 12));
    EXPECT_EQ(loss.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(loss.status().message().find("whole rows [B, 16]"),
              std::string::npos)
        << loss.status();
  });
  TransformerOptions unfused;
  unfused.fused_attention = false;
  RunOnMesh({{"cp", 2}}, [&](int, DeviceMesh& mesh) {
    RingContextParallel split(*mesh.Group("cp"), layout);
    unfused.context_parallel = &split;
    EXPECT_EQ(Transformer::Create(config, unfused).status().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
