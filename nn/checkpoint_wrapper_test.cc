// ActivationCheckpoint: gradients bitwise equal to the unwrapped module,
// finite differences, only the input and the output left in activation
// memory after forward, transparent names, and the exact hook order with the
// recomputation.
#include "nn/checkpoint_wrapper.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/block.h"
#include "nn/gradcheck.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/mlp.h"
#include "nn/sequential.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::RandomTensor;
using testing_util::CheckGradients;
using testing_util::Materialize;

std::unique_ptr<Block> Gpt2Block(int64_t c, int64_t hidden) {
  return std::make_unique<Block>(
      std::make_unique<LayerNorm>(c), std::make_unique<Linear>(c, c),
      std::make_unique<LayerNorm>(c), std::make_unique<Mlp>(c, hidden));
}

bool BitwiseEqual(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

std::vector<std::string> Names(const Module& m) {
  std::vector<std::string> names;
  for (const auto& [name, p] : m.NamedParameters()) names.push_back(name);
  return names;
}

TEST(ActivationCheckpointTest, NamesAreTransparent) {
  Sequential blocks;
  blocks.Append(Gpt2Block(5, 7));
  blocks.Append(std::make_unique<ActivationCheckpoint>(Gpt2Block(5, 7)));
  const std::vector<std::string> names = Names(blocks);
  EXPECT_EQ(names[0], "0.norm1.weight");
  EXPECT_EQ(names[10], "1.norm1.weight");
  EXPECT_EQ(names.back(), "1.mlp.proj.bias");
  std::vector<std::string> modules;
  for (const auto& [name, m] : blocks.NamedModules("blocks")) {
    modules.push_back(name + ":" + m->kind());
  }
  EXPECT_EQ(modules[8], "blocks.1:ActivationCheckpoint");
  EXPECT_EQ(modules[9], "blocks.1:Block");
  EXPECT_EQ(modules[10], "blocks.1.norm1:LayerNorm");
}

TEST(ActivationCheckpointTest, GradientsEqualUnwrappedBitwise) {
  std::unique_ptr<Block> plain = Gpt2Block(5, 7);
  ActivationCheckpoint wrapped(Gpt2Block(5, 7));
  ASSERT_EQ(Names(*plain), Names(wrapped));
  // Same names, same seed: the same weights.
  ASSERT_OK(Materialize(*plain, 1));
  ASSERT_OK(Materialize(wrapped, 1));
  const Tensor x = RandomTensor({2, 3, 5}, DType::kF32, 2);
  const Tensor dy = RandomTensor({2, 3, 5}, DType::kF32, 3);
  for (int step = 0; step < 2; ++step) {  // The second one accumulates.
    ASSERT_OK_AND_ASSIGN(Tensor y_plain, plain->Forward(x));
    ASSERT_OK_AND_ASSIGN(Tensor y_wrapped, wrapped.Forward(x));
    EXPECT_TRUE(BitwiseEqual(y_plain, y_wrapped));
    ASSERT_OK_AND_ASSIGN(Tensor dx_plain, plain->Backward(dy));
    ASSERT_OK_AND_ASSIGN(Tensor dx_wrapped, wrapped.Backward(dy));
    EXPECT_TRUE(BitwiseEqual(dx_plain, dx_wrapped));
    const auto p = plain->NamedParameters();
    const auto w = wrapped.NamedParameters();
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_TRUE(BitwiseEqual(p[i].second->grad, w[i].second->grad))
          << p[i].first << " step " << step;
    }
  }
}

TEST(ActivationCheckpointTest, FiniteDifferenceGradients) {
  ActivationCheckpoint wrapped(Gpt2Block(5, 7));
  ASSERT_OK(Materialize(wrapped, 4));
  EXPECT_TRUE(CheckGradients(wrapped, RandomTensor({2, 3, 5}, DType::kF32, 5)));
}

TEST(ActivationCheckpointTest, KeepsOnlyInputAndOutput) {
  testing_util::ScopedCpuAllocator fresh;
  std::unique_ptr<Block> plain = Gpt2Block(5, 7);
  ActivationCheckpoint wrapped(Gpt2Block(5, 7));
  ASSERT_OK(Materialize(*plain, 6));
  ASSERT_OK(Materialize(wrapped, 6));
  const Tensor x = RandomTensor({2, 3, 5}, DType::kF32, 7);  // kOther
  const Tensor dy = RandomTensor({2, 3, 5}, DType::kF32, 8);
  const int64_t output_bytes = 2 * 3 * 5 * 4;
  auto activations = [&] {
    return fresh.Stats().current_of(MemoryTag::kActivations);
  };
  int64_t plain_saved = 0;
  {
    ASSERT_OK_AND_ASSIGN(Tensor y, plain->Forward(x));
    plain_saved = activations() - output_bytes;
    ASSERT_OK(plain->Backward(dy));
  }
  EXPECT_EQ(activations(), 0);
  {
    ASSERT_OK_AND_ASSIGN(Tensor y, wrapped.Forward(x));
    // Only the output is left: the inner block's activations are freed and
    // the saved input is the caller's tensor.
    EXPECT_EQ(activations(), output_bytes);
    ASSERT_OK(wrapped.Backward(dy));
  }
  EXPECT_EQ(activations(), 0);
  EXPECT_GT(plain_saved, 5 * output_bytes);
}

TEST(ActivationCheckpointTest, HookOrderWithRecomputation) {
  auto seq = std::make_unique<Sequential>();
  Linear* first = seq->Append(std::make_unique<Linear>(5, 7));
  Linear* second = seq->Append(std::make_unique<Linear>(7, 5));
  Sequential* inner = seq.get();
  ActivationCheckpoint wrapped(std::move(seq));
  ASSERT_OK(Materialize(wrapped, 9));
  std::vector<std::string> events;
  auto record = [&](Module* m, const std::string& label) {
    m->AddPreForwardHook([&events, &wrapped, label](Module&) {
      events.push_back(label + ".pre_fwd" +
                       (wrapped.recomputing() ? "(re)" : ""));
      return absl::OkStatus();
    });
    m->AddPostForwardHook([&events, &wrapped, label](Module&) {
      events.push_back(label + ".post_fwd" +
                       (wrapped.recomputing() ? "(re)" : ""));
      return absl::OkStatus();
    });
    m->AddPreBackwardHook([&events, label](Module&) {
      events.push_back(label + ".pre_bwd");
      return absl::OkStatus();
    });
    m->AddPostBackwardHook([&events, label](Module&) {
      events.push_back(label + ".post_bwd");
      return absl::OkStatus();
    });
  };
  record(&wrapped, "ckpt");
  record(inner, "seq");
  record(first, "0");
  record(second, "1");
  ASSERT_OK_AND_ASSIGN(Tensor y,
                       wrapped.Forward(RandomTensor({3, 5}, DType::kF32, 10)));
  EXPECT_EQ(events,
            (std::vector<std::string>{
                "ckpt.pre_fwd", "seq.pre_fwd", "0.pre_fwd", "0.post_fwd",
                "1.pre_fwd", "1.post_fwd", "seq.post_fwd", "ckpt.post_fwd"}));
  events.clear();
  ASSERT_OK(wrapped.Backward(y));
  EXPECT_EQ(events,
            (std::vector<std::string>{
                "ckpt.pre_bwd", "seq.pre_fwd(re)", "0.pre_fwd(re)",
                "0.post_fwd(re)", "1.pre_fwd(re)", "1.post_fwd(re)",
                "seq.post_fwd(re)", "seq.pre_bwd", "1.pre_bwd", "1.post_bwd",
                "0.pre_bwd", "0.post_bwd", "seq.post_bwd", "ckpt.post_bwd"}));
}

TEST(ActivationCheckpointTest, BackwardWithoutForwardFails) {
  ActivationCheckpoint wrapped(std::make_unique<Linear>(5, 5));
  ASSERT_OK(Materialize(wrapped, 11));
  EXPECT_EQ(
      wrapped.Backward(RandomTensor({3, 5}, DType::kF32, 1)).status().code(),
      absl::StatusCode::kFailedPrecondition);
  ASSERT_OK_AND_ASSIGN(Tensor y,
                       wrapped.Forward(RandomTensor({3, 5}, DType::kF32, 1)));
  wrapped.ReleaseSavedTensors();
  EXPECT_EQ(wrapped.Backward(y).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
