// LossScaler: GradScaler's schedule (backoff on overflow, growth after
// growth_interval clean steps, no growth to inf), exact unscaling, and, over
// thread ranks on real Gloo, an inf or NaN on ONE rank's shard making every
// rank skip, with one all-reduce over the mesh (1-D and HSDP 2x2).
#include "optim/loss_scaler.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "optim/counting_groups.h"
#include "tensor/dtensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using P = Placement;

TEST(LossScalerTest, DefaultsMatchGradScaler) {
  LossScaler s = *LossScaler::Create({});
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(s.growth_tracker(), 0);
  for (int i = 0; i < 1999; ++i) s.Update(false);
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(s.growth_tracker(), 1999);
  s.Update(false);  // The 2000th clean step doubles the scale.
  EXPECT_EQ(s.scale(), 131072.0f);
  EXPECT_EQ(s.growth_tracker(), 0);
  s.Update(true);  // Overflow: halve and restart the count.
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_EQ(s.growth_tracker(), 0);
}

TEST(LossScalerTest, BackoffGrowthAndNoGrowthToInfinity) {
  LossScalerOptions o;
  o.init_scale = 8.0;
  o.growth_interval = 3;
  LossScaler s = *LossScaler::Create(o);
  s.Update(false);
  s.Update(false);
  s.Update(true);  // Resets the count before it reaches 3.
  EXPECT_EQ(s.scale(), 4.0f);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 4.0f);
  s.Update(false);
  EXPECT_EQ(s.scale(), 8.0f);
  s.Update(true);
  s.Update(true);
  EXPECT_EQ(s.scale(), 2.0f);

  o.init_scale = 3e38;  // Doubling would overflow f32: the scale stays.
  o.growth_interval = 1;
  LossScaler big = *LossScaler::Create(o);
  big.Update(false);
  EXPECT_EQ(big.scale(), 3e38f);
  EXPECT_EQ(big.growth_tracker(), 0);

  ASSERT_TRUE(s.Restore(1024.0f, 2).ok());
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_EQ(s.growth_tracker(), 2);
  EXPECT_EQ(s.Restore(0.0f, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Restore(1.0f, 3).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LossScalerTest, CreateRejectsBadOptions) {
  for (auto bad : std::vector<LossScalerOptions>{{0.0, 2.0, 0.5, 2000},
                                                 {1e39, 2.0, 0.5, 2000},
                                                 {65536.0, 1.0, 0.5, 2000},
                                                 {65536.0, 2.0, 1.0, 2000},
                                                 {65536.0, 2.0, 0.0, 2000},
                                                 {65536.0, 2.0, 0.5, 0}}) {
    EXPECT_EQ(LossScaler::Create(bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

struct MeshCase {
  std::string label;
  std::vector<MeshAxis> axes;
  std::vector<Placement> placements;
};

class LossScalerMeshTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(LossScalerMeshTest, RankLocalOverflowMakesEveryRankSkip) {
  const MeshCase& mc = GetParam();
  testing_util::RunOnCountingMesh(mc.axes, [&](int rank, DeviceMesh& mesh) {
    LossScaler scaler = *LossScaler::Create({});
    const Tensor full_a =
        testing_util::RandomTensor({9, 4}, DType::kF32, 5, -1000.0f, 1000.0f);
    const Tensor full_b =
        testing_util::RandomTensor({5}, DType::kF32, 6, -1.0f, 1.0f);
    DTensor a = *DTensor::Distribute(full_a, &mesh, mc.placements);
    DTensor b = *DTensor::Distribute(full_b, &mesh, mc.placements);
    ASSERT_TRUE(mesh.FlatGroup().ok());  // Create it outside the count.
    ProcessGroup* flat = *mesh.FlatGroup();
    auto* counting = dynamic_cast<testing_util::CountingProcessGroup*>(flat);
    ASSERT_NE(counting, nullptr);

    // Clean step: exact unscale (a power-of-two scale), step taken.
    const std::vector<float> a_before = *a.local().ToFloats();
    int ops_before = counting->counts().total();
    absl::StatusOr<bool> ok = scaler.UnscaleAndCheck({&a, &b});
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_TRUE(*ok);
    EXPECT_EQ(counting->counts().total() - ops_before, 1);
    const std::vector<float> a_after = *a.local().ToFloats();
    for (size_t j = 0; j < a_after.size(); ++j) {
      ASSERT_EQ(a_after[j], a_before[j] / 65536.0f);
    }
    scaler.Update(!*ok);
    EXPECT_EQ(scaler.growth_tracker(), 1);

    // The last mesh rank alone puts an inf (on `a`) or a NaN (on `b`) into
    // its local shard; every rank must skip.
    const bool culprit = mesh.rank() == mesh.size() - 1;
    for (bool use_nan : {false, true}) {
      DTensor& g = use_nan ? b : a;
      if (culprit && g.local().numel() > 0) {
        std::vector<float> v = *g.local().ToFloats();
        v[0] = use_nan ? std::numeric_limits<float>::quiet_NaN()
                       : std::numeric_limits<float>::infinity();
        *g.mutable_local() = *Tensor::FromFloats(g.local().shape(), v);
      }
      ops_before = counting->counts().total();
      ok = scaler.UnscaleAndCheck({&a, &b});
      ASSERT_TRUE(ok.ok()) << ok.status();
      EXPECT_FALSE(*ok) << mc.label << " rank " << rank
                        << (use_nan ? " nan" : " inf");
      EXPECT_EQ(counting->counts().total() - ops_before, 1);
      scaler.Update(!*ok);
      a = *DTensor::Distribute(full_a, &mesh, mc.placements);
      b = *DTensor::Distribute(full_b, &mesh, mc.placements);
    }
    EXPECT_EQ(scaler.scale(), 16384.0f);
    EXPECT_EQ(scaler.growth_tracker(), 0);
    EXPECT_TRUE(*scaler.UnscaleAndCheck({}));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, LossScalerMeshTest,
    ::testing::Values(MeshCase{"dp3", {{"dp", 3}}, {P::Shard(0)}},
                      MeshCase{"hsdp2x2",
                               {{"replicate", 2}, {"shard", 2}},
                               {P::Replicate(), P::Shard(0)}}),
    [](const ::testing::TestParamInfo<MeshCase>& info) {
      return info.param.label;
    });

TEST(LossScalerTest, RejectsNonF32Grads) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    LossScaler scaler = *LossScaler::Create({});
    DTensor h = *DTensor::Distribute(
        testing_util::RandomTensor({4}, DType::kF16, 1), &mesh, {P::Shard(0)});
    EXPECT_EQ(scaler.UnscaleAndCheck({&h}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(scaler.UnscaleAndCheck({nullptr}).status().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace fsdpp
