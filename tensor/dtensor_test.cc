// DTensor over real Gloo with thread ranks: every placement transition on
// 1-D meshes of 1..5 ranks and on 2-D meshes, dims 0 and 1, even and uneven
// sizes (with empty shards), against the single-rank reference; round trips
// bitwise; norms for every placement mix; async; errors.
#include "tensor/dtensor.h"

#include <cmath>
#include <functional>
#include <thread>
#include <vector>

#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using P = Placement;

// A full tensor of small integers (exact sums in f32), the same on every rank.
Tensor Reference(const Shape& shape, uint64_t seed) {
  std::vector<float> v(NumElements(shape));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = static_cast<float>(static_cast<int>((i * 7 + seed * 13) % 17) - 8);
  }
  return *Tensor::FromFloats(shape, v);
}

std::vector<int> MeshShapeOf(const DeviceMesh& mesh) {
  std::vector<int> s;
  for (const MeshAxis& a : mesh.axes()) s.push_back(a.size);
  return s;
}

// This rank's term of `full` under `placements`: Partial axes split the value
// into per-coordinate terms that reduce back to it exactly (sum: integer
// terms; max: one coordinate holds the value, the others less; avg: copies).
Tensor PartialTerm(const Tensor& full, const DeviceMesh& mesh,
                   const std::vector<Placement>& placements) {
  std::vector<float> v = *full.ToFloats();
  for (size_t axis = 0; axis < placements.size(); ++axis) {
    if (!placements[axis].is_partial()) continue;
    const int w = mesh.axes()[axis].size, c = mesh.coordinate()[axis];
    for (size_t i = 0; i < v.size(); ++i) {
      switch (placements[axis].reduce_op()) {
        case ReduceOp::kSum: {
          const float share =
              static_cast<float>(static_cast<int>((i + axis) % 3) - 1);
          v[i] = c < w - 1 ? share : v[i] - share * (w - 1);
          break;
        }
        case ReduceOp::kMax:
          v[i] = c == 0 ? v[i] : v[i] - 1.0f - c;
          break;
        case ReduceOp::kAvg:
          break;
      }
    }
  }
  return *Tensor::FromFloats(full.shape(), v);
}

DTensor Make(const Tensor& full, DeviceMesh& mesh,
             const std::vector<Placement>& placements) {
  Tensor term = PartialTerm(full, mesh, placements);
  Box box =
      LocalBox(full.shape(), MeshShapeOf(mesh), mesh.coordinate(), placements);
  Tensor local = *Tensor::Empty(box.shape, full.dtype(), Device::Cpu());
  CHECK_OK(
      CopyBox(term, box.offset, &local, Shape(box.shape.size(), 0), box.shape));
  absl::StatusOr<DTensor> dt =
      DTensor::FromLocal(local, &mesh, placements, full.shape());
  CHECK_OK(dt.status());
  return *dt;
}

bool HasAvg(const std::vector<Placement>& p) {
  for (const Placement& x : p) {
    if (x.is_partial() && x.reduce_op() == ReduceOp::kAvg) return true;
  }
  return false;
}

bool HasPartial(const std::vector<Placement>& p) {
  for (const Placement& x : p) {
    if (x.is_partial()) return true;
  }
  return false;
}

// Checks `dt` against the reference `full`: its local box exactly (or within
// avg's rounding), and its reduction when it is Partial.
void ExpectMatches(const DTensor& dt, const Tensor& full, bool approx,
                   const std::string& what) {
  if (HasPartial(dt.placements())) {
    absl::StatusOr<Tensor> reduced = dt.FullTensor();
    ASSERT_TRUE(reduced.ok()) << what << ": " << reduced.status();
    EXPECT_TRUE(testing_util::AllClose(testing_util::Values(*reduced),
                                       testing_util::Values(full),
                                       approx ? 1e-6 : 0, 0))
        << what;
    return;
  }
  const Box box = dt.local_box();
  Tensor expected = *Tensor::Empty(box.shape, full.dtype(), Device::Cpu());
  CHECK_OK(CopyBox(full, box.offset, &expected, Shape(box.shape.size(), 0),
                   box.shape));
  ASSERT_EQ(dt.local().shape(), box.shape) << what;
  EXPECT_TRUE(testing_util::AllClose(testing_util::Values(dt.local()),
                                     testing_util::Values(expected),
                                     approx ? 1e-6 : 0, 0))
      << what;
}

std::string Describe(const std::vector<Placement>& a,
                     const std::vector<Placement>& b, const Shape& shape,
                     const DeviceMesh& mesh) {
  return absl::StrCat(PlacementsToString(a), " -> ", PlacementsToString(b),
                      " of ", ShapeToString(shape), " on ", mesh.ToString());
}

void CheckAllTransitions(DeviceMesh& mesh,
                         const std::vector<std::vector<Placement>>& layouts,
                         const std::vector<Shape>& shapes) {
  for (const Shape& shape : shapes) {
    Tensor full = Reference(shape, shape[0] + 3 * shape[1]);
    for (const auto& from : layouts) {
      DTensor src = Make(full, mesh, from);
      for (const auto& to : layouts) {
        const std::string what = Describe(from, to, shape, mesh);
        absl::StatusOr<DTensor> dst = src.Redistribute(to);
        ASSERT_TRUE(dst.ok()) << what << ": " << dst.status();
        EXPECT_EQ(dst->placements(), to) << what;
        ExpectMatches(*dst, full, HasAvg(from) || HasAvg(to), what);
      }
    }
  }
}

const std::vector<Shape> kShapes = {{7, 3}, {4, 5}, {2, 3}, {6, 1}};

TEST(DTensorTest, EveryTransitionOnOneDimensionalMeshes) {
  const std::vector<std::vector<Placement>> layouts = {
      {P::Shard(0)},
      {P::Shard(1)},
      {P::Replicate()},
      {P::Partial(ReduceOp::kSum)},
      {P::Partial(ReduceOp::kAvg)},
      {P::Partial(ReduceOp::kMax)}};
  for (int w = 1; w <= 5; ++w) {
    testing_util::RunOnMesh({{"dp", w}}, [&](int, DeviceMesh& mesh) {
      CheckAllTransitions(mesh, layouts, kShapes);
    });
  }
}

TEST(DTensorTest, EveryTransitionOnTwoDimensionalMeshes) {
  const std::vector<std::vector<Placement>> layouts = {
      {P::Replicate(), P::Replicate()},
      {P::Shard(0), P::Replicate()},
      {P::Replicate(), P::Shard(0)},
      {P::Shard(0), P::Shard(1)},
      {P::Shard(1), P::Shard(0)},
      {P::Shard(0), P::Shard(0)},
      {P::Shard(1), P::Shard(1)},
      {P::Partial(), P::Replicate()},
      {P::Replicate(), P::Partial()},
      {P::Partial(), P::Shard(0)},
      {P::Shard(1), P::Partial()},
      {P::Partial(), P::Partial()},
      {P::Partial(ReduceOp::kMax), P::Shard(1)}};
  for (auto axes : {std::vector<MeshAxis>{{"replicate", 2}, {"shard", 2}},
                    std::vector<MeshAxis>{{"replicate", 1}, {"shard", 3}},
                    std::vector<MeshAxis>{{"replicate", 2}, {"shard", 1}}}) {
    testing_util::RunOnMesh(axes, [&](int, DeviceMesh& mesh) {
      CheckAllTransitions(mesh, layouts, kShapes);
    });
  }
}

TEST(DTensorTest, RoundTripsAreBitwise) {
  testing_util::RunOnMesh({{"a", 2}, {"b", 2}}, [](int, DeviceMesh& mesh) {
    Tensor full = testing_util::RandomTensor({9, 5}, DType::kF32, 3);
    DTensor dt = *DTensor::Distribute(full, &mesh, {P::Shard(0), P::Shard(1)});
    const std::vector<std::vector<Placement>> chain = {
        {P::Shard(1), P::Shard(0)},
        {P::Replicate(), P::Shard(0)},
        {P::Shard(0), P::Shard(0)},
        {P::Partial(), P::Shard(1)},
        {P::Shard(1), P::Replicate()},
        {P::Replicate(), P::Partial(ReduceOp::kMax)},
        {P::Shard(0), P::Shard(1)}};
    for (const auto& p : chain) dt = *dt.Redistribute(p);
    Tensor back = *dt.FullTensor();
    EXPECT_EQ(testing_util::Values(back), testing_util::Values(full));
  });
}

TEST(DTensorTest, DistributeFromOneRankAndBf16) {
  testing_util::RunOnMesh({{"dp", 3}}, [](int, DeviceMesh& mesh) {
    Tensor full = testing_util::RandomTensor({8, 4}, DType::kBF16, 4);
    Tensor mine = mesh.rank() == 1
                      ? full
                      : *Tensor::Zeros({8, 4}, DType::kBF16, Device::Cpu());
    DTensor dt = *DTensor::Distribute(mine, &mesh, {P::Shard(0)},
                                      DTensor::Source::kBroadcast, 1);
    EXPECT_EQ(dt.local().shape(), (Shape{mesh.rank() == 2 ? 2 : 3, 4}));
    EXPECT_EQ(testing_util::Values(*dt.FullTensor()),
              testing_util::Values(full));
  });
}

TEST(DTensorTest, NormMatchesFullTensorForEveryPlacementMix) {
  testing_util::RunOnMesh(
      {{"replicate", 2}, {"shard", 3}}, [](int, DeviceMesh& mesh) {
        Tensor full = testing_util::RandomTensor({7, 5}, DType::kF32, 5);
        double expected = 0;
        for (float v : testing_util::Values(full)) expected += double(v) * v;
        expected = std::sqrt(expected);
        for (const auto& p : std::vector<std::vector<Placement>>{
                 {P::Replicate(), P::Replicate()},
                 {P::Replicate(), P::Shard(0)},
                 {P::Shard(1), P::Shard(0)},
                 {P::Shard(0), P::Shard(0)},
                 {P::Partial(), P::Shard(1)},
                 {P::Replicate(), P::Partial()}}) {
          DTensor dt = Make(full, mesh, p);
          absl::StatusOr<double> norm = Norm(dt);
          ASSERT_TRUE(norm.ok()) << norm.status();
          EXPECT_NEAR(*norm, expected, 1e-5 * expected)
              << PlacementsToString(p);
        }
      });
}

TEST(DTensorTest, AsyncRedistributeAndElementwiseOps) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    Tensor full = Reference({5, 3}, 1);
    DTensor a = *DTensor::Distribute(full, &mesh, {P::Shard(0)});
    auto pending = a.RedistributeAsync({P::Replicate()});
    ASSERT_TRUE(pending.ok());
    absl::StatusOr<DTensor> r = (*pending)->Wait();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(testing_util::Values(r->local()), testing_util::Values(full));
    DTensor b = *DTensor::Distribute(full, &mesh, {P::Shard(0)});
    DTensor out = *DTensor::Distribute(full, &mesh, {P::Shard(0)});
    ASSERT_TRUE(Add(a, b, &out).ok());
    ASSERT_TRUE(Scale(out, 0.5f, &out).ok());
    EXPECT_EQ(testing_util::Values(*out.FullTensor()),
              testing_util::Values(full));
  });
}

TEST(DTensorTest, ErrorsNameTheProblem) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    Tensor local = *Tensor::Zeros({3, 4}, DType::kF32, Device::Cpu());
    absl::StatusOr<DTensor> bad =
        DTensor::FromLocal(local, &mesh, {P::Shard(0)}, {7, 4});
    // 7 rows over 2 ranks: rank 0 holds [0, 4), rank 1 holds [4, 7).
    if (mesh.rank() == 0) {
      ASSERT_FALSE(bad.ok());
      EXPECT_EQ(bad.status().message(),
                "DTensor::FromLocal: rank 0 of mesh{dp: 2} should hold [4, 4] "
                "of [7, 4] "
                "under [S(0)], got f32[3, 4] cpu");
    } else {
      EXPECT_TRUE(bad.ok()) << bad.status();
    }
    absl::StatusOr<DTensor> wrong =
        DTensor::FromLocal(local, &mesh, {P::Shard(2)}, {3, 4});
    ASSERT_FALSE(wrong.ok());
    EXPECT_NE(
        wrong.status().message().find("S(2) is not a dim of shape [3, 4]"),
        absl::string_view::npos);
    DTensor p = *DTensor::FromLocal(local, &mesh, {P::Partial()}, {3, 4});
    DTensor out = p;
    absl::Status s = Mul(p, p, &out);
    EXPECT_EQ(
        s.message(),
        "DTensor Mul is not supported for placements [P(sum)]: a product of "
        "pending sums is not elementwise");
    EXPECT_FALSE(p.Redistribute({P::Replicate(), P::Replicate()}).ok());
  });
}

}  // namespace
}  // namespace fsdpp
