// Loss parallel against nn::CrossEntropyLoss on the gathered logits, on
// thread ranks over real Gloo: 1-D and 2-D meshes, uneven vocabulary slices,
// ignored targets, f32 and bf16; the logits are never gathered (memory
// accounting); bad placements and calls get clear errors.
#include "parallel/loss_parallel.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "mesh/run_on_mesh.h"
#include "nn/loss.h"
#include "tensor/dtensor.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace parallel {
namespace {

using P = Placement;
using testing_util::RandomTensor;
using testing_util::RunOnMesh;
using testing_util::Values;

constexpr int64_t kIgnore = -100;

// Targets for [2, 9] rows of a vocabulary of v: spread over every slice,
// the last class included, two ignored.
Tensor Targets(int64_t v) {
  std::vector<int64_t> t(18);
  for (int64_t i = 0; i < 18; ++i) t[i] = (i * 11 + 5) % v;
  t[3] = kIgnore;
  t[10] = kIgnore;
  t[17] = v - 1;
  return *Tensor::FromInts({2, 9}, t, DType::kI64);
}

struct Layout {
  std::vector<MeshAxis> axes;
  std::vector<Placement> placements;  // For [2, 9, V] logits.
};

TEST(LossParallelTest, MatchesTheGatheredCrossEntropy) {
  const Layout layouts[] = {
      {{{"tp", 2}}, {P::Shard(2)}},
      {{{"tp", 4}}, {P::Shard(2)}},
      {{{"dp", 2}, {"tp", 2}}, {P::Replicate(), P::Shard(2)}},
  };
  for (const Layout& layout : layouts) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      // 37 = 10 + 10 + 10 + 7 over four ranks: uneven slices.
      const int64_t v = 37;
      const Tensor full = RandomTensor({2, 9, v}, dtype, 7, -6, 6);
      const Tensor targets = Targets(v);
      // The reference on the whole logits.
      nn::CrossEntropyLoss reference(kIgnore);
      const float want = *reference.Forward(full, targets);
      const std::vector<double> want_grad = Values(*reference.Backward(0.5f));
      RunOnMesh(layout.axes, [&](int rank, DeviceMesh& mesh) {
        SCOPED_TRACE(testing::Message()
                     << "rank " << rank << " of " << mesh.ToString() << " "
                     << DTypeName(dtype));
        DTensor logits = *DTensor::Distribute(full, &mesh, layout.placements);
        LossParallelCrossEntropy loss(kIgnore);
        absl::StatusOr<float> got = loss.Forward(logits, targets);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_NEAR(*got, want, 1e-6 * std::fabs(want));
        absl::StatusOr<DTensor> grad = loss.Backward(0.5f);
        ASSERT_TRUE(grad.ok()) << grad.status();
        EXPECT_EQ(grad->placements(), logits.placements());
        EXPECT_EQ(grad->shape(), logits.shape());
        // This rank's slice of the reference gradient.
        const Box box = grad->local_box();
        const int64_t w = box.shape[2], begin = box.offset[2];
        const std::vector<double> got_grad = Values(grad->local());
        const double tol = dtype == DType::kF32 ? 1e-6 : 4e-3;
        for (int64_t r = 0; r < 18; ++r) {
          for (int64_t j = 0; j < w; ++j) {
            ASSERT_NEAR(got_grad[r * w + j], want_grad[r * v + begin + j], tol)
                << "row " << r << " column " << begin + j;
          }
        }
      });
    }
  }
}

// Forward allocates O(rows) per rank, never a gathered [rows, V].
TEST(LossParallelTest, NeverGathersTheLogits) {
  const int64_t rows = 64, v = 4096;
  const Tensor full = RandomTensor({rows, v}, DType::kF32, 8, -4, 4);
  std::vector<int64_t> t(rows);
  for (int64_t i = 0; i < rows; ++i) t[i] = (i * 97) % v;
  const Tensor targets = *Tensor::FromInts({rows}, t, DType::kI64);
  const int64_t full_bytes = full.nbytes();
  Allocator* allocator = GetAllocator(Device::Cpu());
  int64_t before = 0;
  RunOnMesh({{"tp", 2}}, [&](int rank, DeviceMesh& mesh) {
    DTensor logits = *DTensor::Distribute(full, &mesh, {P::Shard(1)});
    ProcessGroup* group = *mesh.Group("tp");
    ASSERT_TRUE((*group->Barrier())->Wait(absl::Seconds(30)).ok());
    if (rank == 0) {
      allocator->ResetPeak();
      before = allocator->Stats().total_current;
    }
    ASSERT_TRUE((*group->Barrier())->Wait(absl::Seconds(30)).ok());
    LossParallelCrossEntropy loss;
    ASSERT_TRUE(loss.Forward(logits, targets).ok());
    ASSERT_TRUE((*group->Barrier())->Wait(absl::Seconds(30)).ok());
    if (rank == 0) {
      const int64_t grew = allocator->Stats().total_peak - before;
      // Both ranks' work buffers: 6 floats per row each.
      EXPECT_GT(grew, 0) << "the allocator saw the statistics' buffers";
      EXPECT_LE(grew, 2 * 6 * rows * 4 + 4096) << "bytes";
      EXPECT_LT(grew, full_bytes / 64);
    }
    ASSERT_TRUE((*group->Barrier())->Wait(absl::Seconds(30)).ok());
  });
}

TEST(LossParallelTest, RejectsLogitsNotShardedOnTheVocabularyAndBadCalls) {
  const Tensor full = RandomTensor({4, 6}, DType::kF32, 9);
  const Tensor targets = *Tensor::FromInts({4}, {0, 1, 2, 3}, DType::kI64);
  RunOnMesh({{"tp", 2}}, [&](int, DeviceMesh& mesh) {
    LossParallelCrossEntropy loss;
    // Rows sharded instead of the vocabulary.
    DTensor rows = *DTensor::Distribute(full, &mesh, {P::Shard(0)});
    absl::Status s = loss.Forward(rows, targets).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("dim 0 is sharded over mesh axis 'tp'"),
              std::string::npos)
        << s;
    DTensor replicated = *DTensor::Distribute(full, &mesh, {P::Replicate()});
    s = loss.Forward(replicated, targets).status();
    EXPECT_NE(s.message().find("is not sharded"), std::string::npos) << s;
    DTensor partial = *DTensor::FromLocal(full, &mesh, {P::Partial()}, {4, 6});
    s = loss.Forward(partial, targets).status();
    EXPECT_NE(s.message().find("Partial on mesh axis 'tp'"), std::string::npos)
        << s;
    // Backward needs a Forward; the targets must match the rows.
    EXPECT_EQ(loss.Backward().status().code(),
              absl::StatusCode::kFailedPrecondition);
    DTensor logits = *DTensor::Distribute(full, &mesh, {P::Shard(1)});
    const Tensor three = *Tensor::FromInts({3}, {0, 1, 2}, DType::kI64);
    EXPECT_EQ(loss.Forward(logits, three).status().code(),
              absl::StatusCode::kInvalidArgument);
    const Tensor outside = *Tensor::FromInts({4}, {0, 1, 2, 6}, DType::kI64);
    s = loss.Forward(logits, outside).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("id 6"), std::string::npos) << s;
    ASSERT_TRUE(loss.Forward(logits, targets).ok());
    EXPECT_EQ(loss.Backward(0.0f).status().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace parallel
}  // namespace fsdpp
