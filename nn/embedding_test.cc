// Embedding: lookup against the table, finite-difference table gradient with
// repeated ids (scatter-add), accumulation, i32/i64 ids, bf16, errors.
#include "nn/embedding.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "nn/gradcheck.h"
#include "nn/linear.h"
#include "nn/sequential.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using testing_util::CheckBf16Forward;
using testing_util::CheckGradients;
using testing_util::GradCheckOptions;
using testing_util::Materialize;

TEST(EmbeddingTest, LooksUpRows) {
  Embedding embedding(7, 5);
  ASSERT_OK(Materialize(embedding, 1));
  for (DType id_dtype : {DType::kI32, DType::kI64}) {
    ASSERT_OK_AND_ASSIGN(
        Tensor ids, Tensor::FromInts({2, 3}, {6, 0, 2, 2, 5, 1}, id_dtype));
    ASSERT_OK_AND_ASSIGN(Tensor y, embedding.Forward(ids));
    EXPECT_EQ(y.shape(), (Shape{2, 3, 5}));
    EXPECT_EQ(y.tag(), MemoryTag::kActivations);
    const std::vector<double> table = Values(embedding.weight()->data);
    const std::vector<double> out = Values(y);
    const std::vector<int> id_values = {6, 0, 2, 2, 5, 1};
    for (int i = 0; i < 6; ++i) {
      for (int c = 0; c < 5; ++c) {
        EXPECT_EQ(out[i * 5 + c], table[id_values[i] * 5 + c]);
      }
    }
  }
}

TEST(EmbeddingTest, TableGradientWithRepeatedIds) {
  Embedding embedding(7, 5);
  ASSERT_OK(Materialize(embedding, 2));
  ASSERT_OK_AND_ASSIGN(
      Tensor ids, Tensor::FromInts({2, 3}, {3, 3, 0, 6, 3, 0}, DType::kI32));
  GradCheckOptions options;
  options.check_input = false;
  EXPECT_TRUE(CheckGradients(embedding, ids, options));
}

TEST(EmbeddingTest, BackwardReturnsUndefinedAndScatterAdds) {
  Embedding embedding(4, 3);
  ASSERT_OK(Materialize(embedding, 3));
  ASSERT_OK_AND_ASSIGN(Tensor ids,
                       Tensor::FromInts({1, 3}, {1, 1, 2}, DType::kI64));
  ASSERT_OK(embedding.Forward(ids));
  ASSERT_OK_AND_ASSIGN(
      Tensor dy, Tensor::FromFloats({1, 3, 3}, {1, 2, 3, 10, 20, 30, 5, 5, 5}));
  ASSERT_OK_AND_ASSIGN(Tensor dx, embedding.Backward(dy));
  EXPECT_FALSE(dx.defined());
  EXPECT_EQ(Values(embedding.weight()->grad),
            (std::vector<double>{0, 0, 0, 11, 22, 33, 5, 5, 5, 0, 0, 0}));
}

TEST(EmbeddingTest, Bf16ForwardAndBf16TableWithF32Gradient) {
  ASSERT_OK_AND_ASSIGN(
      Tensor ids, Tensor::FromInts({2, 3}, {3, 3, 0, 6, 3, 0}, DType::kI32));
  EXPECT_TRUE(CheckBf16Forward(
      [](DType dtype) {
        auto m = std::make_unique<Embedding>(7, 5, 1.0f, dtype);
        return m;
      },
      ids));
  // A bf16 table fed an f32 gradient (e.g. from an f32 head) accumulates it.
  Embedding embedding(7, 5, 1.0f, DType::kBF16);
  ASSERT_OK(Materialize(embedding, 4));
  ASSERT_OK_AND_ASSIGN(Tensor y, embedding.Forward(ids));
  EXPECT_EQ(y.dtype(), DType::kBF16);
  ASSERT_OK(embedding.Backward(RandomTensor({2, 3, 5}, DType::kF32, 5)));
  EXPECT_EQ(embedding.weight()->grad.dtype(), DType::kBF16);
}

TEST(EmbeddingTest, Errors) {
  Embedding embedding(7, 5);
  ASSERT_OK(Materialize(embedding, 6));
  EXPECT_EQ(
      embedding.Forward(RandomTensor({2, 3}, DType::kF32, 1)).status().code(),
      absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(Tensor bad, Tensor::FromInts({2}, {1, 7}, DType::kI32));
  EXPECT_EQ(embedding.Forward(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      embedding.Backward(RandomTensor({2, 5}, DType::kF32, 1)).status().code(),
      absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
