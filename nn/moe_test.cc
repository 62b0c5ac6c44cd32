// MoE and GroupedExperts: finite-difference gradients (softmax and sigmoid
// routers, top-1 and top-2, shared experts, the expert bias, empty groups,
// the auxiliary loss), the routing's counts, and argument errors. The
// comparison with an independent float64 PyTorch reference is
// models:moe_parity_test.
#include "nn/moe.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nn/gradcheck.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using ::testing::HasSubstr;
using testing_util::CheckGradients;
using testing_util::Materialize;

MoeOptions Small(int64_t top_k, int64_t shared_hidden = 0) {
  MoeOptions o;
  o.dim = 5;
  o.hidden = 3;
  o.num_experts = 4;
  o.top_k = top_k;
  o.shared_hidden = shared_hidden;
  return o;
}

std::vector<std::string> Names(const Module& m) {
  std::vector<std::string> names;
  for (const auto& [name, p] : m.NamedParameters()) names.push_back(name);
  return names;
}

TEST(MoeTest, ParametersAreTheRouterTheStackedExpertsAndTheSharedOnes) {
  MoeOptions o = Small(2, 6);
  o.scoring = MoeScoring::kSigmoid;
  o.expert_bias = true;
  MoE moe(o);
  EXPECT_EQ(
      Names(moe),
      (std::vector<std::string>{
          "expert_bias", "gate.weight", "experts.gate_proj", "experts.up_proj",
          "experts.down_proj", "shared_experts.gate.weight",
          "shared_experts.up.weight", "shared_experts.down.weight"}));
  EXPECT_EQ(moe.experts()->gate_proj()->shape, (Shape{4, 3, 5}));
  EXPECT_EQ(moe.experts()->down_proj()->shape, (Shape{4, 5, 3}));
  EXPECT_FALSE(moe.expert_bias()->requires_grad);
}

TEST(MoeTest, SoftmaxTop1Gradients) {
  MoE moe(Small(1));
  ASSERT_OK(Materialize(moe, 1));
  EXPECT_TRUE(CheckGradients(moe, RandomTensor({2, 3, 5}, DType::kF32, 2)));
}

TEST(MoeTest, SoftmaxTop2WithSharedExpertsGradients) {
  MoE moe(Small(2, 6));
  ASSERT_OK(Materialize(moe, 3));
  EXPECT_TRUE(CheckGradients(moe, RandomTensor({2, 3, 5}, DType::kF32, 4)));
}

TEST(MoeTest, UnnormalisedTop2Gradients) {
  MoeOptions o = Small(2);
  o.normalize_top_k = false;
  MoE moe(o);
  ASSERT_OK(Materialize(moe, 5));
  EXPECT_TRUE(CheckGradients(moe, RandomTensor({7, 5}, DType::kF32, 6)));
}

TEST(MoeTest, SigmoidWithBiasAndRouteScaleGradients) {
  MoeOptions o = Small(2, 4);
  o.scoring = MoeScoring::kSigmoid;
  o.expert_bias = true;
  o.route_scale = 2.5f;
  MoE moe(o);
  ASSERT_OK(Materialize(moe, 7));
  EXPECT_TRUE(CheckGradients(moe, RandomTensor({3, 4, 5}, DType::kF32, 8)));
}

TEST(MoeTest, TheBiasSelectsButDoesNotWeigh) {
  MoeOptions o = Small(1);
  o.scoring = MoeScoring::kSigmoid;
  o.expert_bias = true;
  o.route_scale = 1.5f;
  MoE moe(o);
  ASSERT_OK(Materialize(moe, 9));
  ASSERT_OK(Fill(&moe.expert_bias()->data, 0.0f));
  moe.expert_bias()->data.data<float>()[2] = 100.0f;
  const Tensor x = RandomTensor({6, 5}, DType::kF32, 10);
  ASSERT_OK_AND_ASSIGN(Tensor y, moe.Forward(x));
  ASSERT_OK(moe.Backward(x).status());
  MoE::Stats stats = moe.TakeStats();
  EXPECT_EQ(stats.tokens, (std::vector<int64_t>{0, 0, 6, 0}));
  EXPECT_EQ(stats.backwards, 1);
  EXPECT_EQ(moe.TakeStats().tokens, (std::vector<int64_t>{0, 0, 0, 0}));
  // The load is counted apart from the stats, for the bias update.
  EXPECT_EQ(moe.TakeLoad(), (std::vector<int64_t>{0, 0, 6, 0}));
  EXPECT_EQ(moe.TakeLoad(), (std::vector<int64_t>{0, 0, 0, 0}));
  // An evaluation forward counts nothing.
  ASSERT_OK(moe.Forward(x).status());
  moe.ReleaseSavedTensors();
  EXPECT_EQ(moe.TakeStats().backwards, 0);
  // Top-1 normalised: every token's weight is route_scale, whatever the bias:
  // y = 1.5 expert_2(x).
  moe.experts()->SetGroupSizes({0, 0, 6, 0});
  ASSERT_OK_AND_ASSIGN(Tensor e2, moe.experts()->Forward(x));
  moe.ReleaseSavedTensors();
  const std::vector<double> got = Values(y), want = Values(e2);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], 1.5 * want[i], 1e-6) << i;
  }
}

// DeepSeek-V3's update: + rate below the mean load, - rate above, 0 at it,
// then centred (the changes sum to 0).
TEST(MoeTest, ExpertBiasUpdateMovesTowardsTheMeanLoad) {
  // Mean 4: experts 0 and 3 under, 1 over, 2 at it; raw changes
  // {+r, -r, 0, +r} with mean r / 4.
  const double r = 0.001;
  const std::vector<double> delta =
      MoE::ExpertBiasUpdate({1.0, 10.0, 4.0, 1.0}, r);
  const std::vector<double> want = {0.75 * r, -1.25 * r, -0.25 * r, 0.75 * r};
  ASSERT_EQ(delta.size(), want.size());
  double sum = 0.0;
  for (size_t e = 0; e < want.size(); ++e) {
    EXPECT_NEAR(delta[e], want[e], 1e-15) << e;
    sum += delta[e];
  }
  EXPECT_NEAR(sum, 0.0, 1e-15);
  // Even loads move nothing.
  for (double d : MoE::ExpertBiasUpdate({3.0, 3.0, 3.0}, r)) EXPECT_EQ(d, 0.0);
}

TEST(MoeTest, EveryTokenOnOneExpertLeavesTheOthersEmpty) {
  MoE moe(Small(1));
  ASSERT_OK(Materialize(moe, 11));
  // Router row 1 large and the others 0: softmax picks expert 1 for inputs
  // of positive coordinates.
  Tensor& w = moe.gate()->weight()->data;
  ASSERT_OK(Fill(&w, 0.0f));
  for (int i = 0; i < 5; ++i) w.data<float>()[1 * 5 + i] = 3.0f;
  Tensor x = RandomTensor({4, 5}, DType::kF32, 12);
  for (int64_t i = 0; i < x.numel(); ++i) {
    x.data<float>()[i] = std::fabs(x.data<float>()[i]) + 0.1f;
  }
  EXPECT_TRUE(CheckGradients(moe, x));
  const std::vector<int64_t> counts = moe.TakeStats().tokens;
  EXPECT_EQ(counts[0] + counts[2] + counts[3], 0);
  EXPECT_GT(counts[1], 0);
}

// L = sum(dy * y) + aux: Backward's gradients are those of both terms. The
// balance is each sequence's (the rows of [B, T, C]), and aux their mean.
TEST(MoeTest, AuxiliaryLossValueAndGradient) {
  MoeOptions o = Small(2);
  o.aux_loss_coef = 0.3f;
  MoE moe(o);
  ASSERT_OK(Materialize(moe, 13));
  const Tensor x = RandomTensor({3, 3, 5}, DType::kF32, 14);
  const Tensor dy = RandomTensor({3, 3, 5}, DType::kF32, 15);
  auto loss = [&]() -> double {
    absl::StatusOr<Tensor> y = moe.Forward(x);
    CHECK_OK(y.status());
    const std::vector<double> yv = Values(*y), dv = Values(dy);
    double l = moe.last_aux_loss();
    for (size_t i = 0; i < yv.size(); ++i) l += yv[i] * dv[i];
    moe.ReleaseSavedTensors();
    return l;
  };
  // The value by its definition, from the router's softmax.
  ASSERT_OK_AND_ASSIGN(Tensor y, moe.Forward(x));
  const std::vector<double> xv = Values(x),
                            wr = Values(moe.gate()->weight()->data);
  double aux = 0.0;
  for (int q = 0; q < 3; ++q) {
    std::vector<double> p_mean(4, 0.0);
    std::vector<int> counts(4, 0);
    for (int t = q * 3; t < q * 3 + 3; ++t) {
      std::vector<double> l(4), p(4);
      double z = 0.0;
      for (int e = 0; e < 4; ++e) {
        for (int i = 0; i < 5; ++i) l[e] += xv[t * 5 + i] * wr[e * 5 + i];
      }
      for (int e = 0; e < 4; ++e) z += std::exp(l[e]);
      for (int e = 0; e < 4; ++e) p[e] = std::exp(l[e]) / z;
      std::vector<int> order = {0, 1, 2, 3};
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return p[a] > p[b]; });
      ++counts[order[0]];
      ++counts[order[1]];
      for (int e = 0; e < 4; ++e) p_mean[e] += p[e] / 3;
    }
    for (int e = 0; e < 4; ++e) aux += counts[e] / 6.0 * p_mean[e] / 3;
  }
  aux *= 0.3 * 4;
  EXPECT_NEAR(moe.last_aux_loss(), aux, 1e-6);

  moe.set_aux_loss_scale(1.0f);
  ASSERT_OK(moe.ZeroGrad());
  ASSERT_OK(moe.Backward(dy).status());
  const MoE::Stats stats = moe.TakeStats();
  EXPECT_NEAR(stats.aux_loss_sum, aux, 1e-6);
  EXPECT_EQ(stats.backwards, 1);
  int64_t assignments = 0;
  for (int64_t n : stats.tokens) assignments += n;
  EXPECT_EQ(assignments, 9 * 2);
  const std::vector<double> analytic = Values(moe.gate()->weight()->grad);
  Tensor& w = moe.gate()->weight()->data;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const float keep = w.data<float>()[i];
    w.data<float>()[i] = keep + 1e-3f;
    const double up = loss();
    w.data<float>()[i] = keep - 1e-3f;
    const double down = loss();
    w.data<float>()[i] = keep;
    const double numeric = (up - down) / 2e-3;
    EXPECT_NEAR(analytic[i], numeric, 2e-3 + 2e-3 * std::fabs(numeric)) << i;
  }
}

TEST(MoeTest, AuxiliaryLossGradientFollowsTheLossScale) {
  MoeOptions o = Small(1);
  o.aux_loss_coef = 0.5f;
  MoE moe(o);
  ASSERT_OK(Materialize(moe, 16));
  const Tensor x = RandomTensor({5, 5}, DType::kF32, 17);
  ASSERT_OK_AND_ASSIGN(Tensor zero_dy,
                       Tensor::Zeros({5, 5}, DType::kF32, Device::Cpu()));
  std::vector<std::vector<double>> grads;
  for (float scale : {1.0f, 4.0f}) {
    ASSERT_OK(moe.ZeroGrad());
    ASSERT_OK(moe.Forward(x).status());
    moe.set_aux_loss_scale(scale);
    ASSERT_OK(moe.Backward(zero_dy).status());
    grads.push_back(Values(moe.gate()->weight()->grad));
  }
  double norm = 0.0;
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_NEAR(grads[1][i], 4.0 * grads[0][i], 1e-6);
    norm += std::fabs(grads[0][i]);
  }
  EXPECT_GT(norm, 1e-4);  // the aux loss alone reaches the router
}

// Sequences balance on their own: the aux loss of a batch is the mean of
// its parts' (so it does not depend on how ranks and micro-batches split
// the rows).
TEST(MoeTest, AuxiliaryLossOfABatchIsTheMeanOfItsParts) {
  MoeOptions o = Small(2);
  o.aux_loss_coef = 0.1f;
  MoE moe(o);
  ASSERT_OK(Materialize(moe, 22));
  const Tensor x = RandomTensor({4, 6, 5}, DType::kF32, 23);
  ASSERT_OK(moe.Forward(x).status());
  moe.ReleaseSavedTensors();
  const double whole = moe.last_aux_loss();
  double parts = 0.0;
  for (int64_t first : {0, 2}) {
    ASSERT_OK_AND_ASSIGN(Tensor half, x.Narrow(first, 2));
    ASSERT_OK(moe.Forward(half).status());
    moe.ReleaseSavedTensors();
    parts += moe.last_aux_loss() / 2;
  }
  EXPECT_GT(whole, 0.0);
  EXPECT_NEAR(whole, parts, 1e-7);
}

// On meta tensors (the planner's dry run) forward and backward allocate
// what they would and compute nothing.
TEST(MoeTest, MetaForwardAndBackward) {
  MoeOptions o = Small(2, 6);
  o.aux_loss_coef = 0.01f;
  MoE moe(o);
  ASSERT_OK(moe.ZeroGrad());
  ASSERT_OK_AND_ASSIGN(Tensor x,
                       Tensor::Empty({2, 3, 5}, DType::kF32, Device::Meta()));
  ASSERT_OK_AND_ASSIGN(Tensor y, moe.Forward(x));
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.shape(), x.shape());
  ASSERT_OK_AND_ASSIGN(Tensor dx, moe.Backward(x));
  EXPECT_TRUE(dx.is_meta());
  EXPECT_EQ(dx.shape(), x.shape());
  EXPECT_EQ(moe.TakeStats().tokens, (std::vector<int64_t>{0, 0, 0, 0}));
}

TEST(MoeTest, GroupedExpertsWithEmptyGroupsGradients) {
  GroupedExperts experts(4, 5, 3);
  ASSERT_OK(Materialize(experts, 18));
  // CheckGradients runs Forward many times: the sizes are set before each.
  experts.AddPreForwardHook([&](Module&) {
    experts.SetGroupSizes({3, 0, 4, 0});
    return absl::OkStatus();
  });
  EXPECT_TRUE(CheckGradients(experts, RandomTensor({7, 5}, DType::kF32, 19)));
}

// A backward writes the experts' new gradients whole: the groups' dW and
// zeros for the empty ones, never the uninitialised memory (the freed NaN
// buffers of the gradients' sizes are what the allocator hands out next);
// the next backward adds to them.
TEST(MoeTest, GroupedExpertsWriteNewGradientsWhole) {
  GroupedExperts experts(4, 5, 3);
  ASSERT_OK(Materialize(experts, 21));
  const Tensor x = RandomTensor({7, 5}, DType::kF32, 22);
  const Tensor dy = RandomTensor({7, 5}, DType::kF32, 23);
  std::vector<std::vector<double>> once;
  for (int pass = 0; pass < 3; ++pass) {
    if (pass < 2) {
      ASSERT_OK(experts.ZeroGrad(/*set_to_none=*/true));
      std::vector<Tensor> poison;
      for (const auto& [name, p] : experts.LocalParameters()) {
        ASSERT_OK_AND_ASSIGN(
            Tensor t, Tensor::Empty(p->LocalShape(), p->dtype, Device::Cpu(),
                                    MemoryTag::kGrads));
        ASSERT_OK(Fill(&t, std::nanf("")));
        poison.push_back(t);
      }
    }
    experts.SetGroupSizes({3, 0, 4, 0});
    ASSERT_OK(experts.Forward(x));
    ASSERT_OK(experts.Backward(dy));
    const auto params = experts.LocalParameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const std::vector<double> g = Values(params[i].second->grad);
      // Experts 1 and 3 got no rows: their matrices are zeros.
      const int64_t per_expert = static_cast<int64_t>(g.size()) / 4;
      for (int64_t e : {1, 3}) {
        for (int64_t j = 0; j < per_expert; ++j) {
          EXPECT_EQ(g[e * per_expert + j], 0.0) << "param " << i;
        }
      }
      for (double v : g) ASSERT_TRUE(std::isfinite(v)) << "param " << i;
      if (pass == 0) {
        once.push_back(g);
      } else if (pass == 1) {
        EXPECT_EQ(g, once[i]) << "param " << i;
      } else {
        for (size_t j = 0; j < g.size(); ++j) {
          EXPECT_NEAR(g[j], 2.0 * once[i][j], 1e-6) << "param " << i;
        }
      }
    }
  }
}

TEST(MoeTest, GroupSizesMustCoverTheRows) {
  GroupedExperts experts(2, 5, 3);
  ASSERT_OK(Materialize(experts, 20));
  const Tensor x = RandomTensor({4, 5}, DType::kF32, 21);
  experts.SetGroupSizes({1, 2});
  EXPECT_THAT(experts.Forward(x).status().message(),
              HasSubstr("group sizes sum to 3 but the input has 4 rows"));
  experts.SetGroupSizes({1});
  EXPECT_THAT(experts.Forward(x).status().message(),
              HasSubstr("gave 1 sizes for 2 experts"));
  experts.SetGroupSizes({5, -1});
  EXPECT_THAT(experts.Forward(x).status().message(),
              HasSubstr("negative group size -1"));
}

TEST(MoeTest, OptionsAreValidated) {
  MoeOptions o = Small(5);
  EXPECT_THAT(ValidateMoeOptions(o).message(),
              HasSubstr("top_k must be in [1, num_experts = 4], got 5"));
  o = Small(1);
  o.scoring = MoeScoring::kSigmoid;
  o.aux_loss_coef = 0.01f;
  EXPECT_THAT(ValidateMoeOptions(o).message(),
              HasSubstr("aux_loss_coef needs softmax scoring"));
  o = Small(1);
  o.route_scale = 0.0f;
  EXPECT_THAT(ValidateMoeOptions(o).message(), HasSubstr("route_scale"));
  o = Small(1);
  o.num_experts = 0;
  EXPECT_THAT(ValidateMoeOptions(o).message(), HasSubstr("num_experts"));
  EXPECT_TRUE(ValidateMoeOptions(Small(4, 2)).ok());
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
