// Mlp (GELU) and SwiGlu: finite-difference gradients through the children,
// accumulation, hooks of the child Linears, bf16, and names.
#include "nn/mlp.h"

#include <memory>
#include <string>
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

std::vector<std::string> Names(const Module& m) {
  std::vector<std::string> names;
  for (const auto& [name, p] : m.NamedParameters()) names.push_back(name);
  return names;
}

TEST(MlpTest, GeluGradients) {
  Mlp mlp(5, 7);
  EXPECT_EQ(Names(mlp), (std::vector<std::string>{"fc.weight", "fc.bias",
                                                  "proj.weight", "proj.bias"}));
  ASSERT_OK(Materialize(mlp, 1));
  EXPECT_TRUE(CheckGradients(mlp, RandomTensor({2, 3, 5}, DType::kF32, 2)));
}

TEST(MlpTest, DefaultHiddenIsFourTimesDim) {
  Mlp mlp(5);
  EXPECT_EQ(mlp.fc()->out_features(), 20);
  EXPECT_EQ(mlp.proj()->in_features(), 20);
}

TEST(MlpTest, GeluForwardMatchesReference) {
  Mlp mlp(3, 4);
  ASSERT_OK(Materialize(mlp, 3));
  const Tensor x = RandomTensor({2, 3}, DType::kF32, 4);
  ASSERT_OK_AND_ASSIGN(Tensor y, mlp.Forward(x));
  const std::vector<double> xv = Values(x);
  const std::vector<double> w1 = Values(mlp.fc()->weight()->data);
  const std::vector<double> b1 = Values(mlp.fc()->bias()->data);
  const std::vector<double> w2 = Values(mlp.proj()->weight()->data);
  const std::vector<double> b2 = Values(mlp.proj()->bias()->data);
  std::vector<double> expected;
  for (int r = 0; r < 2; ++r) {
    std::vector<double> g(4);
    for (int h = 0; h < 4; ++h) {
      double a = b1[h];
      for (int i = 0; i < 3; ++i) a += xv[r * 3 + i] * w1[h * 3 + i];
      g[h] = 0.5 * a *
             (1 + std::tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)));
    }
    for (int o = 0; o < 3; ++o) {
      double acc = b2[o];
      for (int h = 0; h < 4; ++h) acc += g[h] * w2[o * 4 + h];
      expected.push_back(acc);
    }
  }
  EXPECT_TRUE(AllClose(Values(y), expected, 1e-5, 1e-6));
}

TEST(MlpTest, SwiGluGradients) {
  SwiGlu mlp(5, 7);
  EXPECT_EQ(Names(mlp), (std::vector<std::string>{"gate.weight", "up.weight",
                                                  "down.weight"}));
  ASSERT_OK(Materialize(mlp, 5));
  EXPECT_TRUE(CheckGradients(mlp, RandomTensor({2, 3, 5}, DType::kF32, 6)));
}

TEST(MlpTest, SwiGluForwardMatchesReference) {
  SwiGlu mlp(3, 4);
  ASSERT_OK(Materialize(mlp, 7));
  const Tensor x = RandomTensor({2, 3}, DType::kF32, 8);
  ASSERT_OK_AND_ASSIGN(Tensor y, mlp.Forward(x));
  const std::vector<double> xv = Values(x);
  const std::vector<double> wg = Values(mlp.gate()->weight()->data);
  const std::vector<double> wu = Values(mlp.up()->weight()->data);
  const std::vector<double> wd = Values(mlp.down()->weight()->data);
  std::vector<double> expected;
  for (int r = 0; r < 2; ++r) {
    std::vector<double> p(4);
    for (int h = 0; h < 4; ++h) {
      double a = 0, b = 0;
      for (int i = 0; i < 3; ++i) {
        a += xv[r * 3 + i] * wg[h * 3 + i];
        b += xv[r * 3 + i] * wu[h * 3 + i];
      }
      p[h] = a / (1 + std::exp(-a)) * b;
    }
    for (int o = 0; o < 3; ++o) {
      double acc = 0;
      for (int h = 0; h < 4; ++h) acc += p[h] * wd[o * 4 + h];
      expected.push_back(acc);
    }
  }
  EXPECT_TRUE(AllClose(Values(y), expected, 1e-5, 1e-6));
}

TEST(MlpTest, ChildLinearHooksFire) {
  SwiGlu mlp(5, 7);
  ASSERT_OK(Materialize(mlp, 9));
  std::vector<std::string> events;
  for (const auto& [name, m] : mlp.NamedModules()) {
    const std::string label = name.empty() ? "root" : name;
    m->AddPreForwardHook([&events, label](Module&) {
      events.push_back(label + ".fwd");
      return absl::OkStatus();
    });
    m->AddPostBackwardHook([&events, label](Module&) {
      events.push_back(label + ".bwd");
      return absl::OkStatus();
    });
  }
  ASSERT_OK_AND_ASSIGN(Tensor y,
                       mlp.Forward(RandomTensor({3, 5}, DType::kF32, 10)));
  ASSERT_OK(mlp.Backward(y));
  EXPECT_EQ(events, (std::vector<std::string>{"root.fwd", "gate.fwd", "up.fwd",
                                              "down.fwd", "down.bwd", "up.bwd",
                                              "gate.bwd", "root.bwd"}));
}

TEST(MlpTest, Bf16ForwardCloseToF32) {
  const Tensor x = RandomTensor({2, 3, 5}, DType::kF32, 11);
  EXPECT_TRUE(CheckBf16Forward(
      [](DType dtype) {
        auto m = std::make_unique<Mlp>(5, 7, 0.5f, 0.5f, dtype);
        return m;
      },
      x));
  EXPECT_TRUE(CheckBf16Forward(
      [](DType dtype) {
        auto m = std::make_unique<SwiGlu>(5, 7, 0.5f, 0.5f, dtype);
        return m;
      },
      x));
}

TEST(MlpTest, BackwardWithoutForwardFails) {
  Mlp mlp(5, 7);
  ASSERT_OK(Materialize(mlp, 12));
  EXPECT_EQ(mlp.Backward(RandomTensor({3, 5}, DType::kF32, 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  SwiGlu swiglu(5, 7);
  ASSERT_OK(Materialize(swiglu, 13));
  EXPECT_EQ(
      swiglu.Backward(RandomTensor({3, 5}, DType::kF32, 1)).status().code(),
      absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
