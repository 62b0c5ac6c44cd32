// ActivationCheckpoint: gradients bitwise equal to the unwrapped module
// (full and selective), finite differences, only the input and the output
// left in activation memory after forward (selective: and the matmuls'
// outputs, exactly), transparent names, the exact hook order with the
// recomputation; CheckpointPolicy's forms; SelectiveRecompute's refusals.
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

class ActivationCheckpointModeTest : public ::testing::TestWithParam<bool> {};

TEST_P(ActivationCheckpointModeTest, GradientsEqualUnwrappedBitwise) {
  std::unique_ptr<Block> plain = Gpt2Block(5, 7);
  ActivationCheckpoint wrapped(Gpt2Block(5, 7));
  wrapped.set_selective(GetParam());
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

TEST_P(ActivationCheckpointModeTest, FiniteDifferenceGradients) {
  ActivationCheckpoint wrapped(Gpt2Block(5, 7));
  wrapped.set_selective(GetParam());
  ASSERT_OK(Materialize(wrapped, 4));
  EXPECT_TRUE(CheckGradients(wrapped, RandomTensor({2, 3, 5}, DType::kF32, 5)));
}

INSTANTIATE_TEST_SUITE_P(FullAndSelective, ActivationCheckpointModeTest,
                         ::testing::Bool());

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

  // Selective: the output and the three Linears' outputs ([2, 3, 5] of the
  // attention stand-in, [2, 3, 7] of fc, [2, 3, 5] of proj), nothing else.
  wrapped.set_selective(true);
  {
    ASSERT_OK_AND_ASSIGN(Tensor y, wrapped.Forward(x));
    EXPECT_EQ(activations(), output_bytes + 2 * 3 * (5 + 7 + 5) * 4);
    EXPECT_LT(activations(), plain_saved + output_bytes);
    ASSERT_OK(wrapped.Backward(dy));
  }
  EXPECT_EQ(activations(), 0);
}

TEST(ActivationCheckpointTest, SelectiveReplayNeedsARecordedCall) {
  Linear a(3, 3), b(3, 3);
  SelectiveRecompute store;
  store.Record(&a, {RandomTensor({2, 3}, DType::kF32, 1)});
  ASSERT_OK(store.Replay(&a).status());
  // Once only; and nothing for a module that recorded nothing.
  EXPECT_EQ(store.Replay(&a).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const absl::Status none = store.Replay(&b).status();
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(none.message().find("Linear has no recorded output"),
            std::string::npos)
      << none;
  // Released outputs are not replayed.
  store.Record(&b, {RandomTensor({2, 3}, DType::kF32, 2)});
  for (Tensor* slot : store.Slots()) *slot = Tensor();
  EXPECT_EQ(store.Replay(&b).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Installed only within its scope.
  EXPECT_EQ(SelectiveRecompute::Active(), nullptr);
  {
    SelectiveRecompute::Scope scope(&store, /*replay=*/true);
    EXPECT_EQ(SelectiveRecompute::Active(), &store);
    EXPECT_TRUE(store.replaying());
  }
  EXPECT_EQ(SelectiveRecompute::Active(), nullptr);
}

TEST(CheckpointPolicyTest, FormsAndBlocks) {
  for (const char* text : {"none", "full", "every:1", "every:3", "selective"}) {
    ASSERT_OK_AND_ASSIGN(CheckpointPolicy p, CheckpointPolicy::Parse(text));
    EXPECT_EQ(p.ToString(), text);
  }
  EXPECT_EQ(*CheckpointPolicy::Parse("true"), CheckpointPolicy::Full());
  EXPECT_EQ(*CheckpointPolicy::Parse("false"), CheckpointPolicy::None());
  for (const char* bad : {"", "every:0", "every:", "every:x", "some", "Full"}) {
    const absl::Status s = CheckpointPolicy::Parse(bad).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("\"every:N\" (N >= 1)"), std::string::npos) << s;
  }
  EXPECT_NE(
      CheckpointPolicy::Parse("every:0").status().message().find("\"every:0\""),
      std::string::npos);
  const CheckpointPolicy every3 = CheckpointPolicy::Every(3);
  std::vector<int64_t> wrapped;
  for (int64_t i = 0; i < 7; ++i) {
    if (every3.Wraps(i)) wrapped.push_back(i);
  }
  EXPECT_EQ(wrapped, (std::vector<int64_t>{0, 3, 6}));
  EXPECT_EQ(every3.FullyRecomputed(7), 3);
  EXPECT_EQ(CheckpointPolicy::Full().FullyRecomputed(7), 7);
  EXPECT_EQ(CheckpointPolicy::Selective().FullyRecomputed(7), 0);
  EXPECT_TRUE(CheckpointPolicy::Selective().Wraps(5));
  EXPECT_FALSE(CheckpointPolicy::None().Wraps(0));
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
