// ClipGradNorm over thread ranks on real Gloo, on 1-D and 2-D meshes with
// mixed placements (HSDP's replicate axis, tensors replicated on a sharding
// axis, two sharding axes): the norm equals the full gradient's norm computed
// on one rank, clipping scales every element by exactly the returned
// coefficient, and the groups (wrapped to count their ops) see exactly one
// all-reduce per sharding axis and nothing else. Also non-finite norms,
// argument errors and ZeroGrad.
#include "optim/clip.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "optim/counting_groups.h"
#include "tensor/dtensor.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using P = Placement;
using testing_util::RandomTensor;

struct GradCase {
  Shape shape;
  std::vector<Placement> placements;
};

struct MeshCase {
  std::string label;
  std::vector<MeshAxis> axes;
  std::vector<GradCase> grads;
  std::vector<bool> sharding_axes;  // Axes some grad is sharded on.
};

Tensor FullGrad(size_t i, const Shape& shape) {
  return RandomTensor(shape, DType::kF32, 300 + i, -2.0f, 2.0f);
}

// sqrt(sum of squares) of the full tensors, in double on one rank.
double ReferenceNorm(const std::vector<Tensor>& full) {
  double total = 0.0;
  for (const Tensor& t : full) {
    const std::vector<float> values = *t.ToFloats();
    for (float v : values) total += static_cast<double>(v) * v;
  }
  return std::sqrt(total);
}

class ClipGradNormTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(ClipGradNormTest, NormScalingAndOneAllReducePerShardingAxis) {
  const MeshCase& mc = GetParam();
  std::vector<Tensor> full;
  for (size_t i = 0; i < mc.grads.size(); ++i) {
    full.push_back(FullGrad(i, mc.grads[i].shape));
  }
  const double expected_norm = ReferenceNorm(full);
  testing_util::RunOnCountingMesh(mc.axes, [&](int rank, DeviceMesh& mesh) {
    std::vector<DTensor> grads;
    for (size_t i = 0; i < mc.grads.size(); ++i) {
      grads.push_back(
          *DTensor::Distribute(full[i], &mesh, mc.grads[i].placements));
    }
    std::vector<DTensor*> ptrs;
    for (DTensor& g : grads) ptrs.push_back(&g);

    {
      // The squared norm left on the device: the same collectives, the
      // total rounded to f32 once more.
      std::vector<testing_util::OpCounts> before;
      for (const MeshAxis& a : mesh.axes()) {
        before.push_back(testing_util::AxisCounts(mesh, a.name));
      }
      Tensor norm_sq = *Tensor::Zeros({1}, DType::kF32, Device::Cpu());
      ASSERT_TRUE(GradNormSquaredOnDevice(ptrs, {}, &norm_sq).ok());
      EXPECT_NEAR(std::sqrt(double{(*norm_sq.ToFloats())[0]}), expected_norm,
                  1e-6 * expected_norm)
          << mc.label << " rank " << rank;
      for (int a = 0; a < mesh.ndim(); ++a) {
        EXPECT_EQ(testing_util::AxisCounts(mesh, mesh.axes()[a].name).total() -
                      before[a].total(),
                  mc.sharding_axes[a] ? 1 : 0)
            << mc.label << " axis " << mesh.axes()[a].name;
      }
    }
    for (double ratio : {2.0, 0.5}) {  // No clipping, then clipping.
      SCOPED_TRACE(::testing::Message() << mc.label << " rank " << rank
                                        << " max_norm ratio " << ratio);
      std::vector<testing_util::OpCounts> before;
      for (const MeshAxis& a : mesh.axes()) {
        before.push_back(testing_util::AxisCounts(mesh, a.name));
      }
      const double max_norm = expected_norm * ratio;
      absl::StatusOr<double> norm = ClipGradNorm(ptrs, max_norm);
      ASSERT_TRUE(norm.ok()) << norm.status();
      EXPECT_NEAR(*norm, expected_norm, 1e-6 * expected_norm);

      for (int a = 0; a < mesh.ndim(); ++a) {
        const testing_util::OpCounts after =
            testing_util::AxisCounts(mesh, mesh.axes()[a].name);
        const int want = mc.sharding_axes[a] ? 1 : 0;
        EXPECT_EQ(after.all_reduce - before[a].all_reduce, want)
            << "axis " << mesh.axes()[a].name;
        EXPECT_EQ(after.total() - before[a].total(), want)
            << "axis " << mesh.axes()[a].name;
      }

      const double coef = max_norm / (*norm + 1e-6);
      for (size_t i = 0; i < grads.size(); ++i) {
        std::vector<float> got = *grads[i].FullTensor()->ToFloats();
        std::vector<float> orig = *full[i].ToFloats();
        for (size_t j = 0; j < got.size(); ++j) {
          const float want =
              coef < 1.0 ? static_cast<float>(coef) * orig[j] : orig[j];
          ASSERT_EQ(got[j], want) << "grad " << i << " element " << j;
        }
      }
      // Restore the unclipped grads for the next round.
      for (size_t i = 0; i < grads.size(); ++i) {
        grads[i] = *DTensor::Distribute(full[i], &mesh, mc.grads[i].placements);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, ClipGradNormTest,
    ::testing::Values(MeshCase{"dp1",
                               {{"dp", 1}},
                               {{{7, 5}, {P::Shard(0)}}, {{5}, {P::Shard(0)}}},
                               {true}},
                      // Uneven and empty shards, plus a replicated tensor next
                      // to sharded ones (counted on one rank only).
                      MeshCase{"dp3",
                               {{"dp", 3}},
                               {{{7, 5}, {P::Shard(0)}},
                                {{5}, {P::Shard(0)}},
                                {{2, 3}, {P::Shard(0)}},
                                {{4}, {P::Replicate()}}},
                               {true}},
                      // HSDP: the replicate axis is never reduced over.
                      MeshCase{"hsdp2x2",
                               {{"replicate", 2}, {"shard", 2}},
                               {{{7, 5}, {P::Replicate(), P::Shard(0)}},
                                {{5}, {P::Replicate(), P::Shard(0)}},
                                {{3}, {P::Replicate(), P::Replicate()}}},
                               {false, true}},
                      MeshCase{"hsdp2x3",
                               {{"replicate", 2}, {"shard", 3}},
                               {{{7, 5}, {P::Replicate(), P::Shard(0)}},
                                {{2, 3}, {P::Replicate(), P::Shard(1)}}},
                               {false, true}},
                      // Both axes shard, with every mix of Shard and Replicate.
                      MeshCase{"2d_mixed",
                               {{"a", 2}, {"b", 2}},
                               {{{7, 5}, {P::Shard(0), P::Shard(1)}},
                                {{5}, {P::Shard(0), P::Replicate()}},
                                {{6, 2}, {P::Replicate(), P::Shard(0)}},
                                {{3}, {P::Replicate(), P::Replicate()}}},
                               {true, true}}),
    [](const ::testing::TestParamInfo<MeshCase>& info) {
      return info.param.label;
    });

// GradNorm is ClipGradNorm's norm without the scaling; ClipCoefficient is
// its factor.
// Grads on two meshes over the same ranks (a mixture of experts' experts on
// {efsdp, ep}, the rest on {shard}): each mesh's share reduced over its own
// axes; the norm is the full gradients' and clipping scales all of them.
TEST(ClipGradNormManyMeshesTest, NormOfGradsOnTwoMeshes) {
  const std::vector<Tensor> full = {FullGrad(0, {8, 3}), FullGrad(1, {4, 6}),
                                    FullGrad(2, {5})};
  const double expected_norm = ReferenceNorm(full);
  testing_util::RunOnMesh({{"shard", 4}}, [&](int, DeviceMesh& mesh) {
    std::unique_ptr<DeviceMesh> experts =
        *mesh.Reshape({{"efsdp", 2}, {"ep", 2}}, "experts");
    DTensor dense = *DTensor::Distribute(full[0], &mesh, {P::Shard(0)});
    DTensor expert = *DTensor::Distribute(full[1], experts.get(),
                                          {P::Shard(0), P::Shard(1)});
    DTensor small = *DTensor::Distribute(full[2], &mesh, {P::Replicate()});
    std::vector<DTensor*> grads = {&dense, &expert, &small};
    absl::StatusOr<double> norm = GradNorm(grads);
    ASSERT_TRUE(norm.ok()) << norm.status();
    EXPECT_NEAR(*norm, expected_norm, 1e-5 * expected_norm);
    absl::StatusOr<double> clipped = ClipGradNorm(grads, 0.5 * expected_norm);
    ASSERT_TRUE(clipped.ok()) << clipped.status();
    EXPECT_NEAR(*GradNorm(grads), 0.5 * expected_norm, 1e-5 * expected_norm);
    // The squared norm left on the device: the same, each mesh's share
    // added there.
    Tensor norm_sq = *Tensor::Zeros({1}, DType::kF32, Device::Cpu());
    ASSERT_TRUE(GradNormSquaredOnDevice(grads, {}, &norm_sq).ok());
    EXPECT_NEAR(std::sqrt(*Item(norm_sq)), 0.5 * expected_norm,
                1e-5 * expected_norm);
    // With a pipeline, several meshes need the stage-reduced order (every
    // rank here has them, so every rank refuses).
    PipelineNormOptions pipeline;
    pipeline.pipeline = *mesh.Group("shard");
    const absl::Status refused = GradNorm(grads, pipeline).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(refused.message()).find("stage_reduced"),
              std::string::npos)
        << refused;
  });
}

// A pipeline whose stage 0 holds grads on two meshes (dense on {shard},
// experts on {efsdp, ep}) and stage 1 on one (stage_reduced: each stage's
// share reduced over its own meshes' axes, the stages' shares added over
// pp): the norm is the whole model's on every rank, and clipping scales
// every stage's.
TEST(ClipGradNormManyMeshesTest, PipelineStagesWithAndWithoutExperts) {
  const std::vector<Tensor> full = {FullGrad(0, {8, 3}), FullGrad(1, {4, 6}),
                                    FullGrad(2, {6, 2})};
  const double expected_norm = ReferenceNorm(full);
  testing_util::RunOnMesh(
      {{"pp", 2}, {"shard", 2}}, [&](int, DeviceMesh& mesh) {
        std::unique_ptr<DeviceMesh> expert_mesh =
            *mesh.Reshape({{"pp", 2}, {"efsdp", 1}, {"ep", 2}}, "experts");
        DeviceMesh* stage = *mesh.SubMesh({"shard"});
        DeviceMesh* experts = *expert_mesh->SubMesh({"efsdp", "ep"});
        const bool first = (*mesh.Group("pp"))->rank() == 0;
        std::vector<DTensor> owned;
        if (first) {
          owned.push_back(*DTensor::Distribute(full[0], stage, {P::Shard(0)}));
          owned.push_back(*DTensor::Distribute(full[1], experts,
                                               {P::Shard(0), P::Shard(0)}));
        } else {
          owned.push_back(*DTensor::Distribute(full[2], stage, {P::Shard(0)}));
        }
        std::vector<DTensor*> grads;
        for (DTensor& d : owned) grads.push_back(&d);
        PipelineNormOptions pipeline;
        pipeline.pipeline = *mesh.Group("pp");
        pipeline.stage_reduced = true;
        absl::StatusOr<double> norm = GradNorm(grads, pipeline);
        ASSERT_TRUE(norm.ok()) << norm.status();
        EXPECT_NEAR(*norm, expected_norm, 1e-5 * expected_norm);
        absl::StatusOr<double> clipped =
            ClipGradNorm(grads, 0.5 * expected_norm, pipeline);
        ASSERT_TRUE(clipped.ok()) << clipped.status();
        EXPECT_NEAR(*GradNorm(grads, pipeline), 0.5 * expected_norm,
                    1e-5 * expected_norm);
      });
}

TEST(ClipTest, GradNormAndClipCoefficient) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    DTensor a = *DTensor::Distribute(FullGrad(0, {6, 2}), &mesh, {P::Shard(0)});
    DTensor b = *DTensor::Distribute(FullGrad(0, {6, 2}), &mesh, {P::Shard(0)});
    const std::vector<float> before = *a.local().ToFloats();
    absl::StatusOr<double> norm = GradNorm({&a});
    ASSERT_TRUE(norm.ok()) << norm.status();
    EXPECT_EQ(*a.local().ToFloats(), before);  // Not scaled.
    absl::StatusOr<double> clipped = ClipGradNorm({&b}, *norm / 4);
    ASSERT_TRUE(clipped.ok()) << clipped.status();
    EXPECT_EQ(*clipped, *norm);  // Same grads, same norm.
    const float coef = ClipCoefficient(*norm, *norm / 4);
    EXPECT_EQ(coef, static_cast<float>((*norm / 4) / (*norm + 1e-6)));
    const std::vector<float> after = *b.local().ToFloats();
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(after[i], coef * before[i]) << i;
    }
    EXPECT_EQ(ClipCoefficient(*norm, *norm * 2), 1.0f);
    DTensor partial =
        *DTensor::FromLocal(FullGrad(1, {4}), &mesh, {P::Partial()}, {4});
    const absl::Status s = GradNorm({&partial}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("GradNorm"), std::string::npos) << s;
  });
}

TEST(ClipTest, NonFiniteNormLeavesGradsAlone) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int rank, DeviceMesh& mesh) {
    Tensor full = FullGrad(0, {6, 2});
    std::vector<float> v = *full.ToFloats();
    v[11] = std::numeric_limits<float>::infinity();  // On rank 1's shard.
    full = *Tensor::FromFloats({6, 2}, v);
    DTensor g = *DTensor::Distribute(full, &mesh, {P::Shard(0)});
    const std::vector<float> before = *g.local().ToFloats();
    absl::StatusOr<double> norm = ClipGradNorm({&g}, 1.0);
    ASSERT_TRUE(norm.ok()) << norm.status();
    EXPECT_TRUE(std::isinf(*norm)) << "rank " << rank << ": " << *norm;
    EXPECT_EQ(*g.local().ToFloats(), before);
  });
}

TEST(ClipTest, GradNormSquaredOnDeviceRefusesWhatItCannotDo) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    DTensor g = *DTensor::Distribute(FullGrad(0, {6, 2}), &mesh, {P::Shard(0)});
    Tensor out = *Tensor::Zeros({1}, DType::kF32, Device::Cpu());
    PipelineNormOptions pipeline;
    pipeline.pipeline = mesh.FlatGroup().value();
    absl::Status s = GradNormSquaredOnDevice({&g}, pipeline, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("pipeline"), std::string::npos) << s;
    Tensor two = *Tensor::Zeros({2}, DType::kF32, Device::Cpu());
    s = GradNormSquaredOnDevice({&g}, {}, &two);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("one element"), std::string::npos) << s;
    EXPECT_EQ(GradNormSquaredOnDevice({&g}, {}, nullptr).code(),
              absl::StatusCode::kInvalidArgument);
    // No grads: 0.
    ASSERT_TRUE(Fill(&out, 5.0f).ok());
    ASSERT_TRUE(GradNormSquaredOnDevice({}, {}, &out).ok());
    EXPECT_EQ((*out.ToFloats())[0], 0.0f);
  });
}

TEST(ClipTest, EmptyListAndErrors) {
  testing_util::RunOnCountingMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    EXPECT_EQ(*ClipGradNorm({}, 1.0), 0.0);
    EXPECT_EQ(testing_util::TotalOps(mesh), 0);
    DTensor g = *DTensor::Distribute(FullGrad(0, {4}), &mesh, {P::Shard(0)});
    EXPECT_EQ(ClipGradNorm({&g}, 0.0).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ClipGradNorm({&g}, std::nan("")).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ClipGradNorm({&g, nullptr}, 1.0).status().code(),
              absl::StatusCode::kInvalidArgument);
    DTensor partial =
        *DTensor::FromLocal(FullGrad(1, {4}), &mesh, {P::Partial()}, {4});
    absl::Status s = ClipGradNorm({&g, &partial}, 1.0).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("Partial"), std::string::npos) << s;
    EXPECT_EQ(testing_util::TotalOps(mesh), 0);  // Rejected before any op.
  });
}

// Meta gradients (a dry run's) have no values: norm 0, after the same
// allocations (the collectives are checked in plan/dry_run_test, whose
// simulated groups take meta buffers); mixed with real ones they are
// refused.
TEST(ClipTest, MetaGradientsHaveNormZero) {
  testing_util::RunOnCountingMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    Tensor meta = *Tensor::Empty({4, 3}, DType::kF32, Device::Meta());
    DTensor g = *DTensor::FromLocal(meta, &mesh, {P::Replicate()}, {4, 3});
    absl::StatusOr<double> norm = GradNorm({&g});
    ASSERT_TRUE(norm.ok()) << norm.status();
    EXPECT_EQ(*norm, 0.0);
    EXPECT_EQ(testing_util::TotalOps(mesh), 0);
    DTensor real = *DTensor::Distribute(FullGrad(0, {4}), &mesh, {P::Shard(0)});
    absl::Status s = GradNorm({&g, &real}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("grad 0's device"), std::string::npos) << s;
  });
}

// Pipeline stages on [pp 2, dp 2]: each rank's grads live on its dp
// sub-mesh; the norm adds both stages' totals (one all-gather of the
// totals in double over pp), a grad flagged as not counting (a tied weight's
// second copy) is scaled but left out, and every rank gets the same norm.
TEST(ClipTest, PipelineStagesShareOneNorm) {
  testing_util::RunOnCountingMesh({{"pp", 2}, {"dp", 2}}, [](int,
                                                             DeviceMesh& mesh) {
    DeviceMesh* dp = *mesh.SubMesh({"dp"});
    const int stage = mesh.coordinate()[0];
    // Stage 0: grads 10 + stage and 20; stage 1: its own and a copy of
    // one of stage 0's (grad 20), not counted.
    std::vector<Tensor> full = {FullGrad(10 + stage, {6}), FullGrad(20, {4})};
    std::vector<DTensor> g;
    for (const Tensor& t : full) {
      g.push_back(*DTensor::Distribute(t, dp, {P::Shard(0)}));
    }
    std::vector<Tensor> counted = {FullGrad(10, {6}), FullGrad(11, {6}),
                                   FullGrad(20, {4})};
    const double want = ReferenceNorm(counted);
    PipelineNormOptions pipeline;
    pipeline.pipeline = *mesh.Group("pp");
    pipeline.counts = {true, stage == 0};
    absl::StatusOr<double> norm =
        ClipGradNorm({&g[0], &g[1]}, want / 2, pipeline);
    ASSERT_TRUE(norm.ok()) << norm.status();
    EXPECT_NEAR(*norm, want, 1e-5 * want);
    const float coef = ClipCoefficient(*norm, want / 2);
    for (size_t i = 0; i < g.size(); ++i) {
      const std::vector<float> got = *g[i].FullTensor()->ToFloats();
      const std::vector<float> orig = *full[i].ToFloats();
      for (size_t k = 0; k < got.size(); ++k) {
        EXPECT_EQ(got[k], orig[k] * coef);
      }
    }
    EXPECT_EQ(testing_util::AxisCounts(mesh, "pp").all_gather, 1);
    EXPECT_EQ(testing_util::AxisCounts(mesh, "pp").total(), 1);
    pipeline.counts = {true};
    EXPECT_EQ(ClipGradNorm({&g[0], &g[1]}, 1.0, pipeline).status().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

TEST(ClipTest, ZeroGrad) {
  // Sends nothing: see optim/counting_groups.h.
  testing_util::RunOnCountingMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    DTensor a = *DTensor::Distribute(FullGrad(0, {7, 5}), &mesh, {P::Shard(0)});
    DTensor b = *DTensor::Distribute(FullGrad(1, {3}), &mesh, {P::Shard(0)});
    ASSERT_TRUE(ZeroGrad({&a, &b}).ok());
    for (const DTensor* g : {&a, &b}) {
      const std::vector<float> values = *g->local().ToFloats();
      for (float v : values) EXPECT_EQ(v, 0.0f);
    }
    EXPECT_EQ(ZeroGrad({&a, nullptr}).code(),
              absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace fsdpp
