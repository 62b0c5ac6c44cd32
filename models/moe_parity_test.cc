// nn::MoE against an independent float64 PyTorch reference
// (testdata/moe_reference.py: dense experts under a top-k mask, autograd):
// L = sum(dy * y) + aux, its value, y, dx and every parameter gradient within
// 1e-6 (relative to each tensor's largest element), for softmax top-1 and
// top-2 with and without shared experts and the auxiliary loss, tokens that
// all pick one expert first, and a sigmoid router with an expert bias and a
// route scale.
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "formats/safetensors/safetensors.h"
#include "gtest/gtest.h"
#include "models/torch_reference.h"
#include "nn/moe.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace models {
namespace {

struct MoeCase {
  std::string name;
  int64_t top_k = 1;
  int64_t shared_hidden = 0;
  nn::MoeScoring scoring = nn::MoeScoring::kSoftmax;
  bool normalize = true;
  float route_scale = 1.0f;
  float aux_coef = 0.0f;
  bool expert_bias = false;
  bool one_expert = false;  // the router sends every token to expert 2
};

std::ostream& operator<<(std::ostream& os, const MoeCase& c) {
  return os << c.name;
}

// Uniform(-a, a) values from a fixed LCG (the test's own data).
std::vector<float> Uniform(int64_t n, float a, uint64_t seed) {
  std::vector<float> v(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = a * (2.0f * static_cast<float>(s >> 40) / 16777216.0f - 1.0f);
  }
  return v;
}

class MoeParityTest : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeParityTest, EqualsTheFloat64Reference) {
  if (const auto missing = TorchMissing()) {
    if (RequireTorch()) FAIL() << *missing;
    GTEST_SKIP() << *missing;
  }
  const MoeCase& c = GetParam();
  constexpr int64_t kTokens = 24, kDim = 8, kHidden = 6, kExperts = 4;
  nn::MoeOptions o;
  o.dim = kDim;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.top_k = c.top_k;
  o.scoring = c.scoring;
  o.normalize_top_k = c.normalize;
  o.route_scale = c.route_scale;
  o.shared_hidden = c.shared_hidden;
  o.aux_loss_coef = c.aux_coef;
  o.expert_bias = c.expert_bias;
  o.init_std = 0.4f;
  o.down_init_std = 0.4f;
  nn::MoE moe(o);
  ASSERT_TRUE(moe.ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE(moe.InitWeights(7).ok());
  std::vector<float> x_values = Uniform(kTokens * kDim, 1.0f, 1);
  if (c.expert_bias) {
    const std::vector<float> bias = {0.3f, -0.2f, 0.1f, 0.25f};
    std::copy(bias.begin(), bias.end(), moe.expert_bias()->data.data<float>());
  }
  if (c.one_expert) {
    // Router row 2 large and positive (the others small, and unequal so
    // that a second choice has no ties), inputs positive.
    Tensor& w = moe.gate()->weight()->data;
    for (int64_t i = 0; i < kDim; ++i) w.data<float>()[2 * kDim + i] = 2.0f;
    for (float& x : x_values) x = std::fabs(x) + 0.05f;
  }
  const Tensor x = *Tensor::FromFloats({kTokens, kDim}, x_values);
  const Tensor dy =
      *Tensor::FromFloats({kTokens, kDim}, Uniform(kTokens * kDim, 1.0f, 2));
  ASSERT_TRUE(moe.ZeroGrad().ok());
  absl::StatusOr<Tensor> y = moe.Forward(x);
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<Tensor> dx = moe.Backward(dy);
  ASSERT_TRUE(dx.ok()) << dx.status();
  const std::vector<int64_t> counts = moe.TakeStats().tokens;
  if (c.one_expert) {
    EXPECT_EQ(counts[2], kTokens) << "the router did not pick expert 2 alone";
  }

  double loss = moe.last_aux_loss();
  const std::vector<float> yv = *y->ToFloats(), dyv = *dy.ToFloats();
  for (size_t i = 0; i < yv.size(); ++i) loss += double{yv[i]} * dyv[i];
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"x", x}, {"dy", dy}, {"out.y", *y}, {"out.dx", *dx}};
  for (const auto& [name, p] : moe.NamedParameters()) {
    tensors.push_back({name, p->data});
    if (p->requires_grad) tensors.push_back({"grad." + name, p->grad});
  }
  const std::map<std::string, std::string> metadata = {
      {"top_k", absl::StrCat(c.top_k)},
      {"scoring",
       c.scoring == nn::MoeScoring::kSoftmax ? "softmax" : "sigmoid"},
      {"normalize", c.normalize ? "1" : "0"},
      {"route_scale", absl::StrFormat("%.9g", c.route_scale)},
      {"aux_coef", absl::StrFormat("%.9g", c.aux_coef)},
      {"aux", absl::StrFormat("%.17g", moe.last_aux_loss())},
      {"loss", absl::StrFormat("%.17g", loss)}};
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/moe_",
                                        c.name, ".safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, metadata).ok());
  const auto [status, output] = RunCommand(absl::StrCat(
      "/usr/bin/python3 models/testdata/moe_reference.py '", path, "' 2>&1"));
  std::cout << output << std::flush;
  EXPECT_EQ(status, 0) << output;
}

MoeCase Case(std::string name) {
  MoeCase c;
  c.name = std::move(name);
  return c;
}

std::vector<MoeCase> Cases() {
  std::vector<MoeCase> cases;
  MoeCase c = Case("top1");  // Switch: the raw probability weighs
  c.normalize = false;
  c.aux_coef = 0.01f;
  cases.push_back(c);
  c = Case("top2");
  c.top_k = 2;
  c.aux_coef = 0.01f;
  cases.push_back(c);
  c = Case("top1_normalized_shared");  // w = 1: no routing gradient
  c.shared_hidden = 10;
  cases.push_back(c);
  c = Case("top2_shared_unnormalized");
  c.top_k = 2;
  c.shared_hidden = 10;
  c.normalize = false;
  c.aux_coef = 0.1f;
  cases.push_back(c);
  c = Case("top1_one_expert");
  c.normalize = false;
  c.one_expert = true;
  c.aux_coef = 0.01f;
  cases.push_back(c);
  c = Case("top2_one_expert_shared");
  c.top_k = 2;
  c.shared_hidden = 10;
  c.one_expert = true;
  cases.push_back(c);
  c = Case("sigmoid_top2_bias_shared");
  c.top_k = 2;
  c.scoring = nn::MoeScoring::kSigmoid;
  c.expert_bias = true;
  c.route_scale = 2.5f;
  c.shared_hidden = 10;
  cases.push_back(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Routers, MoeParityTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<MoeCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace models
}  // namespace fsdpp
