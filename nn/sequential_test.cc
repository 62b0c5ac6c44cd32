// Sequential: order of children, names, finite-difference gradients through
// a stack, backward in reverse, and errors naming the failing child.
#include "nn/sequential.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/gradcheck.h"
#include "nn/linear.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::RandomTensor;
using testing_util::CheckGradients;
using testing_util::Materialize;

TEST(SequentialTest, NamesAndGradients) {
  std::vector<std::unique_ptr<Module>> layers;
  layers.push_back(std::make_unique<Linear>(5, 7));
  layers.push_back(std::make_unique<Linear>(7, 3, /*bias=*/false));
  Sequential seq(std::move(layers));
  Linear* last = seq.Append(std::make_unique<Linear>(3, 5));
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_EQ(seq.at(2), last);
  std::vector<std::string> names;
  for (const auto& [name, p] : seq.NamedParameters("blocks")) {
    names.push_back(name);
  }
  EXPECT_EQ(names, (std::vector<std::string>{
                       "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                       "blocks.2.weight", "blocks.2.bias"}));
  ASSERT_OK(Materialize(seq, 1));
  EXPECT_TRUE(CheckGradients(seq, RandomTensor({2, 3, 5}, DType::kF32, 2)));
}

TEST(SequentialTest, EmptyIsIdentity) {
  Sequential seq;
  const Tensor x = RandomTensor({2, 3}, DType::kF32, 3);
  ASSERT_OK_AND_ASSIGN(Tensor y, seq.Forward(x));
  EXPECT_TRUE(y.SharesStorageWith(x));
  ASSERT_OK_AND_ASSIGN(Tensor dx, seq.Backward(x));
  EXPECT_TRUE(dx.SharesStorageWith(x));
}

TEST(SequentialTest, ErrorNamesChild) {
  Sequential seq;
  seq.Append(std::make_unique<Linear>(5, 7));
  seq.Append(std::make_unique<Linear>(6, 3));
  ASSERT_OK(Materialize(seq, 4));
  absl::StatusOr<Tensor> y = seq.Forward(RandomTensor({3, 5}, DType::kF32, 5));
  ASSERT_FALSE(y.ok());
  EXPECT_NE(y.status().message().find("child 1"), std::string::npos)
      << y.status();
  EXPECT_NE(y.status().message().find("Sequential forward"), std::string::npos)
      << y.status();
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
