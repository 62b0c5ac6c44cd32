// Bad input to tensor ops: each case gives InvalidArgument (or
// FailedPrecondition) with a message naming the op and the tensors.
#include "gtest/gtest.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

Tensor T(Shape shape, DType dtype = DType::kF32,
         Device device = Device::Cpu()) {
  return *Tensor::Zeros(std::move(shape), dtype, device);
}

void ExpectError(const absl::Status& s, absl::StatusCode code,
                 const std::string& message) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_EQ(std::string(s.message()), message);
}

TEST(OpsErrorsTest, ShapeDTypeAndDeviceMismatches) {
  Tensor a = T({2, 3}), b = T({3, 2}), out = T({2, 3});
  ExpectError(Add(a, b, &out), absl::StatusCode::kInvalidArgument,
              "Add: shape mismatch (a f32[2, 3] cpu, b f32[3, 2] cpu, out "
              "f32[2, 3] cpu)");
  Tensor h = T({2, 3}, DType::kBF16);
  ExpectError(Mul(a, h, &out), absl::StatusCode::kInvalidArgument,
              "Mul: dtype mismatch (a f32[2, 3] cpu, b bf16[2, 3] cpu, out "
              "f32[2, 3] cpu)");
  Tensor m = T({2, 3}, DType::kF32, Device::Meta());
  ExpectError(
      Add(a, m, &out), absl::StatusCode::kInvalidArgument,
      "Add: tensors are on different devices (a f32[2, 3] cpu, b f32[2, 3] "
      "meta, out f32[2, 3] cpu)");
  Tensor ints = T({2, 3}, DType::kI32), ints_out = T({2, 3}, DType::kI32);
  ExpectError(Gelu(ints, &ints_out), absl::StatusCode::kInvalidArgument,
              "Gelu: x must be f32, bf16 or f16 (x i32[2, 3] cpu)");
  Tensor undefined;
  ExpectError(Scale(undefined, 2.0f, &out), absl::StatusCode::kInvalidArgument,
              "Scale: x is undefined (x undefined, out f32[2, 3] cpu)");
}

TEST(OpsErrorsTest, MatmulShapes) {
  Tensor a = T({4, 5}), b = T({6, 7}), c = T({4, 7});
  ExpectError(
      Matmul(a, b, &c), absl::StatusCode::kInvalidArgument,
      "Matmul: inner dims differ: op(a) is 4 x 5, op(b) is 6 x 7 (a f32[4, 5] "
      "cpu, b f32[6, 7] cpu, c f32[4, 7] cpu)");
  Tensor b2 = T({5, 7}), c2 = T({4, 8});
  ExpectError(Matmul(a, b2, &c2), absl::StatusCode::kInvalidArgument,
              "Matmul: c must be 4 x 7 (a f32[4, 5] cpu, b f32[5, 7] cpu, c "
              "f32[4, 8] cpu)");
  Tensor ab = T({4, 5}, DType::kBF16);
  ExpectError(
      Matmul(ab, b2, &c), absl::StatusCode::kInvalidArgument,
      "Matmul: a and b must have the same float dtype (a bf16[4, 5] cpu, b "
      "f32[5, 7] cpu, c f32[4, 7] cpu)");
  Tensor a3 = T({2, 4, 5}), b3 = T({3, 5, 7}), c3 = T({2, 4, 7});
  ExpectError(
      Matmul(a3, b3, &c3), absl::StatusCode::kInvalidArgument,
      "Matmul: b must have a's batch dims or be 2-D (a f32[2, 4, 5] cpu, b "
      "f32[3, 5, 7] cpu, c f32[2, 4, 7] cpu)");
  Tensor v = T({5});
  ExpectError(
      Matmul(v, b2, &c), absl::StatusCode::kInvalidArgument,
      "Matmul: a, b and c need at least 2 dims (a f32[5] cpu, b f32[5, 7] cpu, "
      "c f32[4, 7] cpu)");
}

TEST(OpsErrorsTest, NormsEmbeddingCrossEntropy) {
  Tensor x = T({3, 8}), w = T({7}), out = T({3, 8}), s = T({3});
  ExpectError(
      RmsNorm(x, w, 1e-5f, &out, &s), absl::StatusCode::kInvalidArgument,
      "RmsNorm: weight must be [8] (x f32[3, 8] cpu, weight f32[7] cpu)");
  Tensor w8 = T({8}), s2 = T({2});
  ExpectError(LayerNorm(x, w8, nullptr, 1e-5f, &out, &s2, &s),
              absl::StatusCode::kInvalidArgument,
              "LayerNorm: mean must be f32 with 3 elements (mean f32[2] cpu)");
  Tensor ids = *Tensor::FromInts({3}, {0, 5, 2}), table = T({4, 8});
  ExpectError(Embedding(ids, table, &out), absl::StatusCode::kInvalidArgument,
              "Embedding: id 5 at position 1 is outside [0, 4)");
  Tensor fids = T({3});
  ExpectError(Embedding(fids, table, &out), absl::StatusCode::kInvalidArgument,
              "Embedding: ids must be i32 or i64 (ids f32[3] cpu)");
  Tensor targets = *Tensor::FromInts({3}, {1, -100, 9}), losses = T({3});
  ExpectError(CrossEntropy(x, targets, -100, &losses),
              absl::StatusCode::kInvalidArgument,
              "CrossEntropy: id 9 at position 2 is outside [0, 8)");
  Tensor short_targets = *Tensor::FromInts({2}, {1, 2});
  ExpectError(
      CrossEntropy(x, short_targets, -100, &losses),
      absl::StatusCode::kInvalidArgument,
      "CrossEntropy: logits must be [.., V] with one row per target (logits "
      "f32[3, 8] cpu, targets i32[2] cpu)");
  Tensor good_targets = *Tensor::FromInts({3}, {1, -100, 7});
  Tensor lse2 = T({2});
  ExpectError(CrossEntropy(x, good_targets, -100, &losses, &lse2),
              absl::StatusCode::kInvalidArgument,
              "CrossEntropy: lse must be f32 with 3 elements (lse f32[2] cpu)");
  Tensor dlosses = T({3}), dx = T({3, 8});
  Tensor lse_bf16 = *Tensor::Empty({3}, DType::kBF16, Device::Cpu());
  ExpectError(
      CrossEntropyBackward(x, good_targets, -100, dlosses, &dx, &lse_bf16),
      absl::StatusCode::kInvalidArgument,
      "CrossEntropyBackward: lse must be f32 with 3 elements (lse "
      "bf16[3] cpu)");
  Tensor y = T({3, 8});
  Tensor sq = T({2, 3, 2});
  Tensor sq_out = T({2, 3, 2});
  ExpectError(Softmax(sq, &sq_out, /*causal=*/true),
              absl::StatusCode::kInvalidArgument,
              "Softmax: causal softmax needs Tq <= Tk (x f32[2, 3, 2] cpu)");
}

TEST(OpsErrorsTest, CudaTensorsNeedACudaBuild) {
#if !defined(FSDPP_WITH_CUDA)
  // No CUDA allocator exists in a CPU build: creating the tensor fails first.
  absl::StatusOr<Tensor> t = Tensor::Empty({2}, DType::kF32, Device::Cuda(0));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
#else
  GTEST_SKIP() << "CUDA build";
#endif
}

}  // namespace
}  // namespace fsdpp
