// RmsNorm: finite-difference gradients of x and weight (odd sizes),
// accumulation, unit RMS output, bf16, mixed dtypes.
#include "nn/rms_norm.h"

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

TEST(RmsNormTest, Gradients) {
  RmsNorm norm(5);
  ASSERT_OK(Materialize(norm, 1));
  EXPECT_TRUE(CheckGradients(norm, RandomTensor({2, 3, 5}, DType::kF32, 2)));
  RmsNorm wide(7);
  ASSERT_OK(Materialize(wide, 3));
  EXPECT_TRUE(CheckGradients(wide, RandomTensor({3, 7}, DType::kF32, 4)));
}

TEST(RmsNormTest, ForwardHasUnitRms) {
  RmsNorm norm(5);
  ASSERT_OK(Materialize(norm, 5, /*randomize=*/false));  // weight 1
  ASSERT_OK_AND_ASSIGN(Tensor y,
                       norm.Forward(RandomTensor({3, 5}, DType::kF32, 6)));
  EXPECT_EQ(y.tag(), MemoryTag::kActivations);
  const std::vector<double> v = Values(y);
  for (int r = 0; r < 3; ++r) {
    double ms = 0;
    for (int c = 0; c < 5; ++c) ms += v[r * 5 + c] * v[r * 5 + c] / 5;
    EXPECT_NEAR(ms, 1.0, 1e-4);
  }
}

TEST(RmsNormTest, Bf16ForwardCloseToF32) {
  EXPECT_TRUE(CheckBf16Forward(
      [](DType dtype) {
        auto m = std::make_unique<RmsNorm>(5, 1e-6f, dtype);
        m->weight()->init = InitSpec::Uniform(0.5f, 1.5f);
        return m;
      },
      RandomTensor({2, 3, 5}, DType::kF32, 7)));
}

TEST(RmsNormTest, Bf16ParametersWithF32Activations) {
  RmsNorm f32(5);
  RmsNorm bf16(5, 1e-6f, DType::kBF16);
  ASSERT_OK(Materialize(f32, 8));
  ASSERT_OK(Materialize(bf16, 8));
  const Tensor x = RandomTensor({2, 3, 5}, DType::kF32, 9);
  const Tensor dy = RandomTensor({2, 3, 5}, DType::kF32, 10);
  ASSERT_OK_AND_ASSIGN(Tensor y_ref, f32.Forward(x));
  ASSERT_OK_AND_ASSIGN(Tensor dx_ref, f32.Backward(dy));
  ASSERT_OK_AND_ASSIGN(Tensor y, bf16.Forward(x));
  EXPECT_EQ(y.dtype(), DType::kF32);
  ASSERT_OK_AND_ASSIGN(Tensor dx, bf16.Backward(dy));
  EXPECT_EQ(bf16.weight()->grad.dtype(), DType::kBF16);
  EXPECT_TRUE(AllClose(Values(y), Values(y_ref), 1e-2, 1e-2));
  EXPECT_TRUE(AllClose(Values(dx), Values(dx_ref), 1e-2, 1e-2));
  EXPECT_TRUE(AllClose(Values(bf16.weight()->grad), Values(f32.weight()->grad),
                       1e-2, 1e-2));
}

TEST(RmsNormTest, Errors) {
  RmsNorm norm(5);
  ASSERT_OK(Materialize(norm, 11));
  EXPECT_EQ(norm.Forward(RandomTensor({3, 4}, DType::kF32, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(norm.Backward(RandomTensor({3, 5}, DType::kF32, 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
