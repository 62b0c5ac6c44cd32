// Block: finite-difference gradients of a whole pre-norm block (LayerNorm +
// Linear stand-in for attention + GELU Mlp, and RmsNorm + SwiGlu), the
// residual structure against its parts, accumulation, bf16, and names.
#include "nn/block.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/gradcheck.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/mlp.h"
#include "nn/rms_norm.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::AllClose;
using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using testing_util::CheckBf16Forward;
using testing_util::CheckGradients;
using testing_util::Materialize;

// GPT-2 style: LayerNorm, attention stand-in Linear(C, C), GELU Mlp.
std::unique_ptr<Block> Gpt2Block(int64_t c, int64_t hidden,
                                 DType dtype = DType::kF32) {
  return std::make_unique<Block>(
      std::make_unique<LayerNorm>(c, 1e-5f, true, dtype),
      std::make_unique<Linear>(c, c, true, 0.02f, dtype),
      std::make_unique<LayerNorm>(c, 1e-5f, true, dtype),
      std::make_unique<Mlp>(c, hidden, 0.02f, 0.02f, dtype));
}

// Llama style: RmsNorm, attention stand-in Linear(C, C, no bias), SwiGlu.
std::unique_ptr<Block> LlamaBlock(int64_t c, int64_t hidden) {
  return std::make_unique<Block>(
      std::make_unique<RmsNorm>(c), std::make_unique<Linear>(c, c, false),
      std::make_unique<RmsNorm>(c), std::make_unique<SwiGlu>(c, hidden));
}

TEST(BlockTest, Names) {
  std::unique_ptr<Block> block = Gpt2Block(5, 7);
  std::vector<std::string> names;
  for (const auto& [name, p] : block->NamedParameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "norm1.weight", "norm1.bias", "attn.weight", "attn.bias",
                       "norm2.weight", "norm2.bias", "mlp.fc.weight",
                       "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"}));
}

TEST(BlockTest, Gpt2BlockGradients) {
  std::unique_ptr<Block> block = Gpt2Block(5, 7);
  ASSERT_OK(Materialize(*block, 1));
  EXPECT_TRUE(CheckGradients(*block, RandomTensor({2, 3, 5}, DType::kF32, 2)));
}

TEST(BlockTest, LlamaBlockGradients) {
  std::unique_ptr<Block> block = LlamaBlock(5, 7);
  ASSERT_OK(Materialize(*block, 3));
  EXPECT_TRUE(CheckGradients(*block, RandomTensor({2, 3, 5}, DType::kF32, 4)));
}

TEST(BlockTest, ForwardIsPreNormResidual) {
  std::unique_ptr<Block> block = Gpt2Block(5, 7);
  ASSERT_OK(Materialize(*block, 5));
  const Tensor x = RandomTensor({2, 3, 5}, DType::kF32, 6);
  ASSERT_OK_AND_ASSIGN(Tensor z, block->Forward(x));
  // Recompute from the parts: y = x + attn(norm1(x)); z = y + mlp(norm2(y)).
  ASSERT_OK_AND_ASSIGN(Tensor h, block->norm1()->Forward(x));
  ASSERT_OK_AND_ASSIGN(Tensor a, block->attn()->Forward(h));
  std::vector<double> y = Values(x);
  const std::vector<double> av = Values(a);
  for (size_t i = 0; i < y.size(); ++i) y[i] += av[i];
  ASSERT_OK_AND_ASSIGN(
      Tensor yt,
      Tensor::FromFloats(x.shape(), std::vector<float>(y.begin(), y.end())));
  ASSERT_OK_AND_ASSIGN(Tensor h2, block->norm2()->Forward(yt));
  ASSERT_OK_AND_ASSIGN(Tensor m, block->mlp()->Forward(h2));
  const std::vector<double> mv = Values(m);
  for (size_t i = 0; i < y.size(); ++i) y[i] += mv[i];
  EXPECT_TRUE(AllClose(Values(z), y, 1e-6, 1e-6));
  block->ReleaseSavedTensors();
}

TEST(BlockTest, Bf16ForwardCloseToF32) {
  EXPECT_TRUE(CheckBf16Forward(
      [](DType dtype) -> std::unique_ptr<Module> {
        std::unique_ptr<Block> block = Gpt2Block(5, 7, dtype);
        for (const auto& [name, p] : block->NamedParameters()) {
          p->init = InitSpec::Uniform(-0.5f, 0.5f);
        }
        return block;
      },
      RandomTensor({2, 3, 5}, DType::kF32, 7)));
}

TEST(BlockTest, ChildErrorsPropagate) {
  std::unique_ptr<Block> block = Gpt2Block(5, 7);
  ASSERT_OK(Materialize(*block, 8));
  EXPECT_FALSE(block->Forward(RandomTensor({2, 4}, DType::kF32, 9)).ok());
  EXPECT_EQ(
      block->Backward(RandomTensor({2, 5}, DType::kF32, 9)).status().code(),
      absl::StatusCode::kFailedPrecondition);
}

// Two forwards in flight: the first's saved tensors stashed while the second
// runs forward and backward, then restored for the first's backward. The
// gradients equal the two forward/backward pairs run one after the other,
// bitwise, in the order the backwards ran; a restore onto a block that holds
// another forward's tensors, or from another block, is refused.
TEST(BlockTest, StashedForwardsBackwardLikeSequentialOnes) {
  for (bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt2");
    std::unique_ptr<Block> a = llama ? LlamaBlock(5, 7) : Gpt2Block(5, 7);
    std::unique_ptr<Block> b = llama ? LlamaBlock(5, 7) : Gpt2Block(5, 7);
    ASSERT_OK(Materialize(*a, 7));
    ASSERT_OK(Materialize(*b, 7));
    const Tensor x0 = RandomTensor({2, 3, 5}, DType::kF32, 8);
    const Tensor x1 = RandomTensor({2, 3, 5}, DType::kF32, 9);
    const Tensor dy0 = RandomTensor({2, 3, 5}, DType::kF32, 10);
    const Tensor dy1 = RandomTensor({2, 3, 5}, DType::kF32, 11);

    ASSERT_OK(a->Forward(x0).status());
    Module::SavedTensors first = a->StashSavedTensors();
    EXPECT_GT(first.bytes(), 0);
    ASSERT_OK(a->Forward(x1).status());
    EXPECT_EQ(a->RestoreSavedTensors(std::move(first)).code(),
              absl::StatusCode::kFailedPrecondition);
    ASSERT_OK_AND_ASSIGN(Tensor dx1, a->Backward(dy1));
    // `first` was refused and is gone: stash again from a fresh forward.
    ASSERT_OK(a->Forward(x0).status());
    first = a->StashSavedTensors();
    EXPECT_EQ(b->RestoreSavedTensors(a->StashSavedTensors()).code(),
              absl::StatusCode::kOk);  // empty: nothing to restore
    ASSERT_OK(a->RestoreSavedTensors(std::move(first)));
    ASSERT_OK_AND_ASSIGN(Tensor dx0, a->Backward(dy0));

    ASSERT_OK(b->Forward(x1).status());
    ASSERT_OK_AND_ASSIGN(Tensor ref_dx1, b->Backward(dy1));
    ASSERT_OK(b->Forward(x0).status());
    ASSERT_OK_AND_ASSIGN(Tensor ref_dx0, b->Backward(dy0));
    EXPECT_EQ(Values(dx0), Values(ref_dx0));
    EXPECT_EQ(Values(dx1), Values(ref_dx1));
    const auto pa = a->NamedParameters(), pb = b->NamedParameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_EQ(Values(pa[i].second->grad), Values(pb[i].second->grad))
          << pa[i].first;
    }
    // Tensors stashed from one block do not restore into another.
    ASSERT_OK(a->Forward(x0).status());
    EXPECT_EQ(b->RestoreSavedTensors(a->StashSavedTensors()).code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
