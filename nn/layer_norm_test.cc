// LayerNorm: finite-difference gradients of x, weight and bias (odd sizes,
// with and without bias), accumulation, saved statistics tagged as
// activations, bf16 and mixed dtypes.
#include "nn/layer_norm.h"

#include <cmath>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "nn/gradcheck.h"
#include "tensor/ops.h"
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

TEST(LayerNormTest, Gradients) {
  LayerNorm norm(5);
  ASSERT_OK(Materialize(norm, 1));
  EXPECT_TRUE(CheckGradients(norm, RandomTensor({2, 3, 5}, DType::kF32, 2)));
}

TEST(LayerNormTest, GradientsWithoutBias) {
  LayerNorm norm(7, 1e-5f, /*bias=*/false);
  ASSERT_OK(Materialize(norm, 3));
  EXPECT_EQ(norm.bias(), nullptr);
  EXPECT_TRUE(CheckGradients(norm, RandomTensor({3, 7}, DType::kF32, 4)));
}

TEST(LayerNormTest, ForwardNormalisesRows) {
  LayerNorm norm(5);
  ASSERT_OK(Materialize(norm, 5, /*randomize=*/false));  // weight 1, bias 0
  ASSERT_OK_AND_ASSIGN(Tensor y,
                       norm.Forward(RandomTensor({3, 5}, DType::kF32, 6)));
  EXPECT_EQ(y.tag(), MemoryTag::kActivations);
  const std::vector<double> v = Values(y);
  for (int r = 0; r < 3; ++r) {
    double mean = 0, var = 0;
    for (int c = 0; c < 5; ++c) mean += v[r * 5 + c] / 5;
    for (int c = 0; c < 5; ++c) var += std::pow(v[r * 5 + c] - mean, 2) / 5;
    EXPECT_NEAR(mean, 0.0, 1e-6);
    EXPECT_NEAR(var, 1.0, 1e-3);
  }
}

TEST(LayerNormTest, SavedStatisticsAreActivations) {
  testing_util::ScopedCpuAllocator fresh;
  LayerNorm norm(5);
  ASSERT_OK(Materialize(norm, 7));
  const Tensor x = RandomTensor({2, 3, 5}, DType::kF32, 8);
  EXPECT_EQ(fresh.Stats().current_of(MemoryTag::kActivations), 0);
  ASSERT_OK_AND_ASSIGN(Tensor y, norm.Forward(x));
  // Output (30 floats) + mean and rstd (6 floats each).
  EXPECT_EQ(fresh.Stats().current_of(MemoryTag::kActivations),
            (30 + 6 + 6) * 4);
  ASSERT_OK(norm.Backward(y));
  y = Tensor();
  EXPECT_EQ(fresh.Stats().current_of(MemoryTag::kActivations), 0);
}

TEST(LayerNormTest, Bf16ForwardCloseToF32) {
  EXPECT_TRUE(CheckBf16Forward(
      [](DType dtype) {
        auto m = std::make_unique<LayerNorm>(5, 1e-5f, true, dtype);
        m->weight()->init = InitSpec::Uniform(0.5f, 1.5f);
        m->bias()->init = InitSpec::Uniform(-1, 1);
        return m;
      },
      RandomTensor({2, 3, 5}, DType::kF32, 9)));
}

TEST(LayerNormTest, MixedDTypes) {
  // f32 parameters with bf16 activations, against all-f32.
  LayerNorm norm(5);
  ASSERT_OK(Materialize(norm, 10));
  const Tensor x = RandomTensor({2, 3, 5}, DType::kBF16, 11);
  const Tensor dy = RandomTensor({2, 3, 5}, DType::kBF16, 12);
  ASSERT_OK_AND_ASSIGN(Tensor x32,
                       Tensor::Empty(x.shape(), DType::kF32, Device::Cpu()));
  ASSERT_OK(Copy(x, &x32));
  ASSERT_OK_AND_ASSIGN(Tensor dy32,
                       Tensor::Empty(x.shape(), DType::kF32, Device::Cpu()));
  ASSERT_OK(Copy(dy, &dy32));
  ASSERT_OK_AND_ASSIGN(Tensor y32, norm.Forward(x32));
  ASSERT_OK_AND_ASSIGN(Tensor dx32, norm.Backward(dy32));
  const std::vector<double> dw32 = Values(norm.weight()->grad);
  const std::vector<double> db32 = Values(norm.bias()->grad);
  ASSERT_OK(norm.ZeroGrad(true));
  ASSERT_OK_AND_ASSIGN(Tensor y, norm.Forward(x));
  EXPECT_EQ(y.dtype(), DType::kBF16);
  ASSERT_OK_AND_ASSIGN(Tensor dx, norm.Backward(dy));
  EXPECT_EQ(dx.dtype(), DType::kBF16);
  EXPECT_EQ(norm.weight()->grad.dtype(), DType::kF32);
  EXPECT_TRUE(AllClose(Values(y), Values(y32), 2e-2, 2e-2));
  EXPECT_TRUE(AllClose(Values(dx), Values(dx32), 5e-2, 5e-2));
  EXPECT_TRUE(AllClose(Values(norm.weight()->grad), dw32, 2e-2, 2e-2));
  EXPECT_TRUE(AllClose(Values(norm.bias()->grad), db32, 2e-2, 2e-2));
}

TEST(LayerNormTest, Errors) {
  LayerNorm norm(5);
  ASSERT_OK(Materialize(norm, 13));
  EXPECT_EQ(norm.Forward(RandomTensor({3, 4}, DType::kF32, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(norm.Backward(RandomTensor({3, 5}, DType::kF32, 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
