// Expert parallelism over thread ranks on real Gloo: a MoE split over ep = 2
// and 4 ranks, each with its own tokens, gives every rank the outputs and
// input gradients the unsplit MoE gives those tokens, each rank's experts
// the unsplit gradients of those experts (every rank's tokens), and the
// router and shared experts gradients that sum over the ranks to the
// unsplit ones; the all-to-alls send exactly the rows the routing sends
// away (counted); tensor parallelism inside the MoE, alone and under expert
// parallelism, equals it too; ShardExperts' errors.
#include "parallel/expert_parallel.h"

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "fsdp/fully_shard.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "nn/gradcheck.h"
#include "optim/counting_groups.h"
#include "parallel/tensor_parallel.h"
#include "tensor/ops.h"
#include "tensor/sharding.h"
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

// The values of the box [offset, offset + size) of `all` (row-major
// `shape`), in the box's row-major order.
std::vector<double> Box(const std::vector<double>& all, const Shape& shape,
                        const Shape& offset, const Shape& size) {
  std::vector<double> out;
  std::vector<int64_t> i(shape.size(), 0);
  const int64_t n = NumElements(size);
  for (int64_t k = 0; k < n; ++k) {
    int64_t rest = k, flat = 0;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      i[d] = rest % size[d];
      rest /= size[d];
    }
    for (size_t d = 0; d < shape.size(); ++d) {
      flat = flat * shape[d] + offset[d] + i[d];
    }
    out.push_back(all[flat]);
  }
  return out;
}

// Tensor parallelism inside the MoE (the MixtureOfExperts style, sequence
// parallel stream), alone (ep 1) and under expert parallelism (ep 2): every
// rank's output and input gradient are its sequence slice of the unsplit
// MoE's on its ep rank's tokens; each rank's pieces of the experts' stacks
// and of the shared experts hold the boxes of the unsplit gradients (summed
// over the ep ranks' tokens for the shared ones); the router's gradient,
// all-reduced over tp, sums over the ep ranks to the unsplit one, with the
// auxiliary loss's counted once.
class ExpertTensorParallelTest
    : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(ExpertTensorParallelTest, EqualsTheUnsplitMoe) {
  const auto [ep, tp] = GetParam();
  constexpr int64_t kSeqTp = 6;
  nn::MoeOptions options = Options();
  options.hidden = 6;  // divisible by tp
  const Tensor x = RandomTensor({ep * kRows, kSeqTp, kDim}, DType::kF32, 11);
  const Tensor dy = RandomTensor({ep * kRows, kSeqTp, kDim}, DType::kF32, 12);
  nn::MoE whole(options);
  ASSERT_OK(nn::testing_util::Materialize(whole, 5));
  ASSERT_OK(whole.ZeroGrad());
  ASSERT_OK_AND_ASSIGN(Tensor y_whole, whole.Forward(x));
  whole.set_aux_loss_scale(static_cast<float>(ep));
  ASSERT_OK_AND_ASSIGN(Tensor dx_whole, whole.Backward(dy));
  std::map<std::string, std::vector<double>> want;
  std::map<std::string, Shape> shapes;
  for (const auto& [name, p] : whole.NamedParameters()) {
    if (!p->requires_grad) continue;
    want[name] = Values(p->grad);
    shapes[name] = p->shape;
  }
  const int64_t slice = kSeqTp / tp;
  // Its sequence slice of rows [q kRows, (q + 1) kRows) of t [R, T, C].
  const auto mine = [&](const Tensor& t, int q, int r) {
    Tensor rows = Rows(t, q * kRows, kRows);
    Tensor out =
        *Tensor::Empty({kRows, slice, kDim}, DType::kF32, Device::Cpu());
    const absl::Status copied =
        CopyBox(rows, {0, r * slice, 0}, &out, {0, 0, 0}, {kRows, slice, kDim});
    EXPECT_TRUE(copied.ok()) << copied;
    return out;
  };

  std::mutex mu;
  // name -> tp rank -> the sum over the ep ranks of that rank's gradient.
  std::map<std::string, std::map<int, std::vector<double>>> summed;
  std::map<std::string, std::map<int, ParameterPiece>> pieces;
  testing_util::RunOnCountingMesh(
      {{"ep", ep}, {"tp", tp}}, [&](int, DeviceMesh& mesh) {
        const int q = (*mesh.Group("ep"))->rank();
        const int r = (*mesh.Group("tp"))->rank();
        nn::MoE moe(options);
        ASSERT_OK(nn::testing_util::Materialize(moe, 5));
        ASSERT_OK(ParallelizeModule(
            &moe, &mesh,
            {{"", ParallelStyle::MixtureOfExperts(Layout::kShardSequence)}}));
        ExpertParallel parallel(*mesh.Group("ep"));
        if (ep > 1) ASSERT_OK(ShardExperts(moe, &parallel));
        EXPECT_EQ(moe.experts()->local_experts(), kExperts / ep);
        EXPECT_EQ(moe.experts()->local_hidden(), options.hidden / tp);
        ASSERT_OK(moe.ZeroGrad());
        ASSERT_OK_AND_ASSIGN(Tensor y, moe.Forward(mine(x, q, r)));
        ASSERT_OK_AND_ASSIGN(Tensor dx, moe.Backward(mine(dy, q, r)));
        const std::string where = absl::StrCat(" of ep ", q, " tp ", r);
        ExpectNear(Values(y), Values(mine(y_whole, q, r)), "y" + where);
        ExpectNear(Values(dx), Values(mine(dx_whole, q, r)), "dx" + where);
        for (const auto& [name, p] : moe.NamedParameters()) {
          if (!p->requires_grad) continue;
          if (name.rfind("experts.", 0) == 0) {
            // Every ep rank's tokens reach these experts: whole gradients.
            ExpectNear(
                Values(p->grad),
                Box(want[name], p->shape, p->piece.offset, p->piece.size),
                name + where);
            continue;
          }
          std::lock_guard<std::mutex> lock(mu);
          std::vector<double>& sum = summed[name][r];
          const std::vector<double> g = Values(p->grad);
          sum.resize(g.size(), 0.0);
          for (size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
          pieces[name][r] = p->piece;
        }
      });
  EXPECT_EQ(summed.size(), 4u);  // the router and the shared SwiGLU's three
  for (const auto& [name, by_tp] : summed) {
    ASSERT_EQ(static_cast<int>(by_tp.size()), tp) << name;
    for (const auto& [r, sum] : by_tp) {
      const ParameterPiece& piece = pieces[name][r];
      const bool cut = !piece.size.empty();
      EXPECT_EQ(cut, name != "gate.weight") << name;
      ExpectNear(sum,
                 cut ? Box(want[name], shapes[name], piece.offset, piece.size)
                     : want[name],
                 absl::StrCat(name, " of tp rank ", r));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EpTp, ExpertTensorParallelTest,
                         ::testing::Values(std::make_pair(1, 2),
                                           std::make_pair(2, 2)));

// FSDP of expert stacks cut by tp (hidden) and ep (experts): the masters
// are DTensors on [ep, tp, shard] of the whole stack, placed Shard(0) on ep,
// the hidden dim on tp and Shard(0) (of this rank's experts) on the shard
// axis; each rank keeps its rows.
TEST(ExpertTensorParallelFsdpTest, MastersArePlacedOnEveryAxis) {
  nn::MoeOptions options = Options();
  options.hidden = 6;
  testing_util::RunOnCountingMesh(
      {{"efsdp", 2}, {"ep", 2}, {"tp", 2}}, [&](int, DeviceMesh& mesh) {
        nn::MoE moe(options);
        ASSERT_OK(ParallelizeModule(
            &moe, &mesh,
            {{"", ParallelStyle::MixtureOfExperts(Layout::kReplicate)}}));
        ExpertParallel parallel(*mesh.Group("ep"));
        ASSERT_OK(ShardExperts(moe, &parallel));
        fsdp::FullyShardOptions fo;
        fo.mesh = &mesh;
        fo.ep_axis = "ep";
        fo.tp_axis = "ep";
        const absl::Status same =
            fsdp::FullyShard({moe.experts()}, fo).status();
        EXPECT_THAT(same.message(), HasSubstr("both 'ep'"));
        fo.tp_axis = "tp";
        ASSERT_OK(fsdp::FullyShard({moe.experts()}, fo).status());
        std::map<std::string, std::string> placed;
        for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(&moe)) {
          placed[sp->name] =
              absl::StrCat(PlacementsToString(sp->master.placements()), " ",
                           ShapeToString(sp->master.shape()), " ",
                           ShapeToString(sp->master.local().shape()));
        }
        EXPECT_EQ(placed["experts.gate_proj"],
                  "[S(0), S(1), S(0)] [8, 6, 6] [2, 3, 6]");
        EXPECT_EQ(placed["experts.down_proj"],
                  "[S(0), S(2), S(0)] [8, 6, 6] [2, 6, 3]");
      });
}

TEST(ExpertParallelErrorsTest, TheMixtureOfExpertsStyleSaysWhatIsWrong) {
  testing_util::RunOnCountingMesh({{"tp", 2}}, [&](int, DeviceMesh& mesh) {
    nn::MoE moe(Options());  // hidden 5
    const absl::Status odd = ParallelizeModule(
        &moe, &mesh,
        {{"", ParallelStyle::MixtureOfExperts(Layout::kShardSequence)}});
    EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(odd.message(),
                HasSubstr("the experts' hidden width (5) is not divisible by "
                          "the tp size 2"));
    EXPECT_FALSE(moe.experts()->gate_proj()->has_piece());  // unchanged
    const absl::Status not_moe = ParallelizeModule(
        &moe, &mesh,
        {{"gate", ParallelStyle::MixtureOfExperts(Layout::kReplicate)}});
    EXPECT_THAT(not_moe.message(), HasSubstr("needs an MoE"));
  });
}

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
