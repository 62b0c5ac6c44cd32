// Expert parallelism over thread ranks on real Gloo: a MoE split over ep = 2
// and 4 ranks, each with its own tokens, gives every rank the outputs and
// input gradients the unsplit MoE gives those tokens, each rank's experts
// the unsplit gradients of those experts (every rank's tokens), and the
// router and shared experts gradients that sum over the ranks to the
// unsplit ones; the all-to-alls send exactly the rows the routing sends
// away (counted); ShardExperts' errors.
#include "parallel/expert_parallel.h"

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "nn/gradcheck.h"
#include "optim/counting_groups.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace parallel {
namespace {

using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using ::testing::HasSubstr;

constexpr int64_t kDim = 6, kHidden = 5, kExperts = 8, kRows = 2, kSeq = 5;

nn::MoeOptions Options() {
  nn::MoeOptions o;
  o.dim = kDim;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.top_k = 2;
  o.shared_hidden = 4;
  o.aux_loss_coef = 0.05f;
  return o;
}

// The rows [first, first + n) of x [R, T, C].
Tensor Rows(const Tensor& x, int64_t first, int64_t n) {
  return *x.Narrow(first, n);
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0.0, worst = 0.0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want[i]));
  }
  EXPECT_LE(worst, 1e-5 * std::max(scale, 1e-3)) << what;
}

class ExpertParallelTest : public ::testing::TestWithParam<int> {};

TEST_P(ExpertParallelTest, EqualsTheUnsplitMoeOnEveryRanksTokens) {
  const int ep = GetParam();
  const Tensor x = RandomTensor({ep * kRows, kSeq, kDim}, DType::kF32, 1);
  const Tensor dy = RandomTensor({ep * kRows, kSeq, kDim}, DType::kF32, 2);

  // The unsplit MoE on every rank's tokens. Each rank's loss has its own
  // sequences' aux mean; their sum is ep times the whole batch's mean.
  nn::MoE whole(Options());
  ASSERT_OK(nn::testing_util::Materialize(whole, 3));
  ASSERT_OK(whole.ZeroGrad());
  ASSERT_OK_AND_ASSIGN(Tensor y_whole, whole.Forward(x));
  whole.set_aux_loss_scale(static_cast<float>(ep));
  ASSERT_OK_AND_ASSIGN(Tensor dx_whole, whole.Backward(dy));
  const double aux_whole = whole.last_aux_loss();
  std::map<std::string, std::vector<double>> want;
  for (const auto& [name, p] : whole.NamedParameters()) {
    if (p->requires_grad) want[name] = Values(p->grad);
  }

  std::mutex mu;
  std::map<std::string, std::vector<double>> summed;  // router, shared
  std::vector<std::vector<int64_t>> sizes(ep);        // rows per expert
  std::vector<int64_t> sent(ep);
  double aux_sum = 0.0;
  testing_util::RunOnCountingMesh({{"ep", ep}}, [&](int rank,
                                                    DeviceMesh& mesh) {
    ExpertParallel parallel(*mesh.Group("ep"));
    nn::MoE moe(Options());
    ASSERT_OK(nn::testing_util::Materialize(moe, 3));
    ASSERT_OK(ShardExperts(moe, &parallel));
    EXPECT_EQ(moe.experts()->local_experts(), kExperts / ep);
    ASSERT_OK(moe.ZeroGrad());
    const testing_util::OpBytes before = testing_util::AxisBytes(mesh, "ep");
    ASSERT_OK_AND_ASSIGN(Tensor y, moe.Forward(Rows(x, rank * kRows, kRows)));
    ASSERT_OK_AND_ASSIGN(Tensor dx,
                         moe.Backward(Rows(dy, rank * kRows, kRows)));
    ExpectNear(Values(y), Values(Rows(y_whole, rank * kRows, kRows)),
               absl::StrCat("y of rank ", rank));
    ExpectNear(Values(dx), Values(Rows(dx_whole, rank * kRows, kRows)),
               absl::StrCat("dx of rank ", rank));
    // This rank's experts: the unsplit gradients of experts [q L, (q+1) L).
    const int64_t local = kExperts / ep;
    for (Parameter* p : {moe.experts()->gate_proj(), moe.experts()->up_proj(),
                         moe.experts()->down_proj()}) {
      const std::string name =
          p == moe.experts()->gate_proj()
              ? "experts.gate_proj"
              : (p == moe.experts()->up_proj() ? "experts.up_proj"
                                               : "experts.down_proj");
      const std::vector<double>& all = want[name];
      const int64_t per_expert = p->shape[1] * p->shape[2];
      ExpectNear(
          Values(p->grad),
          std::vector<double>(all.begin() + rank * local * per_expert,
                              all.begin() + (rank + 1) * local * per_expert),
          absl::StrCat(name, " of rank ", rank));
    }
    const nn::MoE::Stats stats = moe.TakeStats();
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [name, p] : moe.NamedParameters()) {
      if (!p->requires_grad || name.rfind("experts.", 0) == 0) continue;
      std::vector<double>& s = summed[name];
      const std::vector<double> g = Values(p->grad);
      s.resize(g.size(), 0.0);
      for (size_t i = 0; i < g.size(); ++i) s[i] += g[i];
    }
    sizes[rank] = stats.tokens;
    aux_sum += stats.aux_loss_sum;
    sent[rank] = testing_util::AxisBytes(mesh, "ep").all_to_all_v_sent -
                 before.all_to_all_v_sent;
  });
  EXPECT_NEAR(aux_sum, ep * aux_whole, 1e-6);
  for (const auto& [name, s] : summed) ExpectNear(s, want[name], name);
  EXPECT_EQ(summed.size(), 4u);  // the router and the shared SwiGLU's three
  // Bytes: forward and backward each send a rank's rows for other ranks'
  // experts out and the rows it received for its experts back.
  const int64_t local = kExperts / ep;
  for (int r = 0; r < ep; ++r) {
    int64_t rows_out = 0, rows_in = 0;
    for (int64_t e = 0; e < kExperts; ++e) {
      if (e / local != r) rows_out += sizes[r][e];
      for (int s = 0; s < ep; ++s) {
        if (s != r && e / local == r) rows_in += sizes[s][e];
      }
    }
    EXPECT_EQ(sent[r], 2 * (rows_out + rows_in) * kDim *
                           static_cast<int64_t>(sizeof(float)))
        << "rank " << r;
    EXPECT_GT(rows_out + rows_in, 0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(EpSizes, ExpertParallelTest, ::testing::Values(2, 4));

TEST(ExpertParallelErrorsTest, ShardExpertsSaysWhatIsWrong) {
  testing_util::RunOnCountingMesh({{"ep", 3}}, [&](int, DeviceMesh& mesh) {
    ExpertParallel parallel(*mesh.Group("ep"));
    nn::MoE moe(Options());
    const absl::Status status = ShardExperts(moe, &parallel);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(),
                HasSubstr("has 8 experts, which the ep size 3 does not "
                          "divide"));
    EXPECT_EQ(moe.experts()->local_experts(), kExperts);  // unchanged
    EXPECT_EQ(moe.expert_parallelism(), nullptr);
  });
  testing_util::RunOnCountingMesh({{"ep", 2}}, [&](int, DeviceMesh& mesh) {
    ExpertParallel parallel(*mesh.Group("ep"));
    nn::MoE moe(Options());
    ASSERT_OK(ShardExperts(moe, &parallel));
    const absl::Status again = ShardExperts(moe, &parallel);
    EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(again.message(), HasSubstr("split already"));
  });
}

}  // namespace
}  // namespace parallel
}  // namespace fsdpp
