// CrossEntropyLoss: mean over non-ignored targets against a double
// reference, finite-difference dlogits of the mean, ignore_index, the
// all-ignored case (0 and zero gradient), bf16 logits, errors.
#include "nn/loss.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/gradcheck.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::AllClose;
using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;

constexpr int64_t kIgnore = -100;

// Mean of -log softmax(row)[target] over non-ignored rows (double).
double ReferenceLoss(const std::vector<double>& logits,
                     const std::vector<int64_t>& targets, int64_t v) {
  double total = 0;
  int count = 0;
  for (size_t r = 0; r < targets.size(); ++r) {
    if (targets[r] == kIgnore) continue;
    double mx = -INFINITY;
    for (int64_t c = 0; c < v; ++c) mx = std::max(mx, logits[r * v + c]);
    double s = 0;
    for (int64_t c = 0; c < v; ++c) s += std::exp(logits[r * v + c] - mx);
    total += std::log(s) + mx - logits[r * v + targets[r]];
    ++count;
  }
  return count == 0 ? 0.0 : total / count;
}

TEST(CrossEntropyLossTest, MeanAndFiniteDifferenceGradient) {
  const std::vector<int64_t> targets = {3, kIgnore, 0, 10, 10, kIgnore};
  ASSERT_OK_AND_ASSIGN(Tensor t,
                       Tensor::FromInts({2, 3}, targets, DType::kI64));
  Tensor logits = RandomTensor({2, 3, 11}, DType::kF32, 1, -3, 3);
  CrossEntropyLoss loss(kIgnore);
  ASSERT_OK_AND_ASSIGN(float value, loss.Forward(logits, t));
  EXPECT_EQ(loss.count(), 4);
  const std::vector<double> lv = Values(logits);
  EXPECT_NEAR(value, ReferenceLoss(lv, targets, 11), 1e-6);
  ASSERT_OK_AND_ASSIGN(Tensor dlogits, loss.Backward());
  EXPECT_EQ(dlogits.shape(), logits.shape());
  // Central differences of the f32 loss.
  std::vector<double> numeric(lv.size());
  float* p = logits.data<float>();
  const double h = 1e-3;
  for (size_t i = 0; i < lv.size(); ++i) {
    const float keep = p[i];
    p[i] = keep + h;
    ASSERT_OK_AND_ASSIGN(float up, loss.Forward(logits, t));
    p[i] = keep - h;
    ASSERT_OK_AND_ASSIGN(float down, loss.Forward(logits, t));
    p[i] = keep;
    numeric[i] = (static_cast<double>(up) - down) / (2 * h);
  }
  EXPECT_TRUE(AllClose(Values(dlogits), numeric, 1e-3, 1e-3));
  // Ignored rows get exactly zero.
  const std::vector<double> g = Values(dlogits);
  for (int c = 0; c < 11; ++c) {
    EXPECT_EQ(g[1 * 11 + c], 0.0);
    EXPECT_EQ(g[5 * 11 + c], 0.0);
  }
}

// A normalizer replaces the count: the loss is the sum / normalizer, its
// gradient the count's scaled by count / normalizer (ignored rows still
// zero), the accumulated loss the same, and a clone keeps it; a negative or
// non-finite one is refused.
TEST(CrossEntropyLossTest, NormalizerDividesTheSum) {
  const std::vector<int64_t> targets = {3, kIgnore, 0, 10, 10, kIgnore};
  ASSERT_OK_AND_ASSIGN(Tensor t,
                       Tensor::FromInts({2, 3}, targets, DType::kI64));
  Tensor logits = RandomTensor({2, 3, 11}, DType::kF32, 3, -3, 3);
  CrossEntropyLoss mean(kIgnore);
  ASSERT_OK_AND_ASSIGN(float by_count, mean.Forward(logits, t));
  ASSERT_OK_AND_ASSIGN(Tensor d_count, mean.Backward(2.0f));
  CrossEntropyLoss loss(kIgnore);
  ASSERT_OK(loss.set_normalizer(10.0));
  EXPECT_EQ(loss.Divisor(4), 10.0);
  ASSERT_OK_AND_ASSIGN(float value, loss.Forward(logits, t));
  const double reference = ReferenceLoss(Values(logits), targets, 11) * 4 / 10;
  EXPECT_NEAR(value, reference, 1e-6);
  EXPECT_NEAR(value, by_count * 0.4, 1e-6);
  ASSERT_OK_AND_ASSIGN(Tensor d, loss.Backward(2.0f));
  std::vector<double> expected = Values(d_count);
  for (double& x : expected) x *= 0.4;
  EXPECT_TRUE(AllClose(Values(d), expected, 1e-6, 1e-7));
  ASSERT_OK_AND_ASSIGN(Tensor sum,
                       Tensor::Zeros({1}, DType::kF32, Device::Cpu()));
  ASSERT_OK(loss.ForwardAccumulate(logits, t, 0.5, &sum));
  EXPECT_NEAR(Values(sum)[0], 0.5 * reference, 1e-6);
  std::unique_ptr<LossFunction> clone = loss.Clone();
  EXPECT_EQ(clone->normalizer(), 10.0);
  ASSERT_OK_AND_ASSIGN(float cloned, clone->Forward(logits, t));
  EXPECT_EQ(cloned, value);
  ASSERT_OK(loss.set_normalizer(0));
  ASSERT_OK_AND_ASSIGN(float back, loss.Forward(logits, t));
  EXPECT_EQ(back, by_count);
  EXPECT_EQ(loss.set_normalizer(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(loss.set_normalizer(NAN).code(),
            absl::StatusCode::kInvalidArgument);
}

// Targets checked on the host (all in [0, v), so none is the negative
// ignore_index) are counted without reading them back: the same loss.
TEST(CrossEntropyLossTest, HostCheckedTargetsGiveTheSameLoss) {
  const std::vector<int64_t> targets = {3, 0, 10, 10, 7, 1};
  Tensor logits = RandomTensor({2, 3, 11}, DType::kF32, 2, -3, 3);
  ASSERT_OK_AND_ASSIGN(Tensor plain,
                       Tensor::FromInts({2, 3}, targets, DType::kI32));
  ASSERT_OK_AND_ASSIGN(Tensor checked,
                       Tensor::FromInts({2, 3}, targets, DType::kI32));
  checked.MarkIdsCheckedBelow(11);
  CrossEntropyLoss loss(kIgnore);
  ASSERT_OK_AND_ASSIGN(float a, loss.Forward(logits, plain));
  ASSERT_OK_AND_ASSIGN(float b, loss.Forward(logits, checked));
  EXPECT_EQ(a, b);
  EXPECT_EQ(loss.count(), 6);
  EXPECT_NEAR(b, ReferenceLoss(Values(logits), targets, 11), 1e-6);
}

// ForwardAccumulate leaves weight x the mean loss in a tensor (added to what
// is there) and saves the same for Backward as Forward; the default of the
// interface (a loss without its own) adds Forward's value.
TEST(CrossEntropyLossTest, ForwardAccumulateAddsTheWeightedMean) {
  const std::vector<int64_t> targets = {3, 0, kIgnore, 10, 7, 1};
  Tensor logits = RandomTensor({2, 3, 11}, DType::kF32, 4, -3, 3);
  ASSERT_OK_AND_ASSIGN(Tensor t,
                       Tensor::FromInts({2, 3}, targets, DType::kI32));
  CrossEntropyLoss loss(kIgnore);
  ASSERT_OK_AND_ASSIGN(float mean, loss.Forward(logits, t));
  ASSERT_OK_AND_ASSIGN(Tensor want, loss.Backward(0.5f));
  ASSERT_OK_AND_ASSIGN(Tensor sum, Tensor::FromFloats({1}, {1.0f}));
  ASSERT_TRUE(loss.ForwardAccumulate(logits, t, 0.25, &sum).ok());
  EXPECT_EQ(loss.count(), 5);
  EXPECT_NEAR(Values(sum)[0], 1.0 + 0.25 * mean, 1e-6);
  ASSERT_OK_AND_ASSIGN(Tensor got, loss.Backward(0.5f));
  EXPECT_EQ(Values(got), Values(want));
  // A second micro-batch adds to it.
  ASSERT_TRUE(loss.ForwardAccumulate(logits, t, 0.25, &sum).ok());
  EXPECT_NEAR(Values(sum)[0], 1.0 + 0.5 * mean, 1e-6);

  // The interface's default, through a loss that only has Forward.
  class ForwardOnly final : public LossFunction {
   public:
    absl::StatusOr<float> Forward(const Tensor&, const Tensor&) override {
      return 3.0f;
    }
    absl::StatusOr<Tensor> Backward(float) override { return Tensor(); }
    int64_t ignore_index() const override { return -100; }
    int64_t count() const override { return 1; }
    std::unique_ptr<LossFunction> Clone() const override {
      return std::make_unique<ForwardOnly>();
    }
  };
  ForwardOnly only;
  ASSERT_TRUE(only.ForwardAccumulate(logits, t, 0.5, &sum).ok());
  EXPECT_NEAR(Values(sum)[0], 1.0 + 0.5 * mean + 1.5, 1e-6);

  // The sum must be one f32 element on the logits' device.
  ASSERT_OK_AND_ASSIGN(Tensor two, Tensor::FromFloats({2}, {0.0f, 0.0f}));
  absl::Status s = loss.ForwardAccumulate(logits, t, 1.0, &two);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("one element"), std::string::npos) << s;
  EXPECT_EQ(loss.ForwardAccumulate(logits, t, 1.0, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CrossEntropyLossTest, AllIgnoredGivesZeroAndZeroGradient) {
  ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::FromInts({3}, {-1, -1, -1}));
  const Tensor logits = RandomTensor({3, 5}, DType::kF32, 2);
  CrossEntropyLoss loss(/*ignore_index=*/-1);
  ASSERT_OK_AND_ASSIGN(float value, loss.Forward(logits, t));
  EXPECT_EQ(value, 0.0f);
  EXPECT_EQ(loss.count(), 0);
  ASSERT_OK_AND_ASSIGN(Tensor dlogits, loss.Backward());
  for (double v : Values(dlogits)) EXPECT_EQ(v, 0.0);
}

TEST(CrossEntropyLossTest, Bf16LogitsCloseToF32) {
  ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::FromInts({4}, {1, 2, 0, 6}));
  const Tensor logits32 = RandomTensor({4, 7}, DType::kF32, 3, -2, 2);
  ASSERT_OK_AND_ASSIGN(Tensor logits16,
                       Tensor::Empty({4, 7}, DType::kBF16, Device::Cpu()));
  ASSERT_OK(Copy(logits32, &logits16));
  CrossEntropyLoss loss;
  ASSERT_OK_AND_ASSIGN(float l32, loss.Forward(logits32, t));
  ASSERT_OK_AND_ASSIGN(Tensor g32, loss.Backward());
  ASSERT_OK_AND_ASSIGN(float l16, loss.Forward(logits16, t));
  ASSERT_OK_AND_ASSIGN(Tensor g16, loss.Backward());
  EXPECT_EQ(g16.dtype(), DType::kBF16);
  EXPECT_NEAR(l16, l32, 2e-2 * std::fabs(l32));
  EXPECT_TRUE(AllClose(Values(g16), Values(g32), 2e-2, 2e-3));
}

TEST(CrossEntropyLossTest, Errors) {
  CrossEntropyLoss loss;
  EXPECT_EQ(loss.Backward().status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::FromInts({3}, {1, 2, 0}));
  EXPECT_EQ(
      loss.Forward(RandomTensor({4, 5}, DType::kF32, 1), t).status().code(),
      absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(Tensor out_of_range, Tensor::FromInts({3}, {1, 5, 0}));
  EXPECT_FALSE(
      loss.Forward(RandomTensor({3, 5}, DType::kF32, 1), out_of_range).ok());
  // Backward releases the saved logits.
  ASSERT_OK(loss.Forward(RandomTensor({3, 5}, DType::kF32, 1), t));
  ASSERT_OK(loss.Backward());
  EXPECT_EQ(loss.Backward().status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(CrossEntropyLossTest, ScaledBackwardIsTheScaledGradient) {
  ASSERT_OK_AND_ASSIGN(Tensor t,
                       Tensor::FromInts({4}, {1, kIgnore, 0, 4}, DType::kI64));
  Tensor logits = RandomTensor({4, 5}, DType::kF32, 3, -2, 2);
  CrossEntropyLoss loss(kIgnore);
  ASSERT_OK(loss.Forward(logits, t));
  ASSERT_OK_AND_ASSIGN(Tensor plain, loss.Backward());
  ASSERT_OK(loss.Forward(logits, t));
  // A power of two: scaling is exact, so the results must be bitwise.
  ASSERT_OK_AND_ASSIGN(Tensor scaled, loss.Backward(0.25f));
  std::vector<double> expected = Values(plain);
  for (double& v : expected) v *= 0.25;
  EXPECT_EQ(Values(scaled), expected);
  for (float bad : {0.0f, -1.0f, std::nanf("")}) {
    ASSERT_OK(loss.Forward(logits, t));
    absl::Status s = loss.Backward(bad).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("Backward scale must be finite and > 0"),
              absl::string_view::npos)
        << s;
  }
}

// gradient_in_place: the same gradient bitwise (f32 and bf16, ignored rows
// and targets anywhere in a row, a vocabulary not a multiple of the vector
// width), written over the logits; no new buffer.
TEST(CrossEntropyLossTest, GradientInPlaceIsTheSameGradient) {
  ASSERT_OK_AND_ASSIGN(
      Tensor t, Tensor::FromInts({5}, {1, kIgnore, 0, 36, 20}, DType::kI64));
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const Tensor logits = RandomTensor({5, 37}, dtype, 9, -3, 3);
    CrossEntropyLoss plain(kIgnore);
    ASSERT_OK_AND_ASSIGN(float plain_loss, plain.Forward(logits, t));
    ASSERT_OK_AND_ASSIGN(Tensor expected, plain.Backward(0.5f));
    ASSERT_OK_AND_ASSIGN(Tensor copy,
                         Tensor::Empty(logits.shape(), dtype, Device::Cpu()));
    ASSERT_OK(Copy(logits, &copy));
    CrossEntropyLoss in_place(kIgnore, /*gradient_in_place=*/true);
    const std::unique_ptr<LossFunction> clone = in_place.Clone();
    EXPECT_TRUE(
        dynamic_cast<const CrossEntropyLoss&>(*clone).gradient_in_place());
    ASSERT_OK_AND_ASSIGN(float loss, in_place.Forward(copy, t));
    EXPECT_EQ(loss, plain_loss);
    ASSERT_OK_AND_ASSIGN(Tensor got, in_place.Backward(0.5f));
    EXPECT_EQ(got.raw_data(), copy.raw_data()) << "not in place";
    EXPECT_EQ(Values(got), Values(expected)) << DTypeName(dtype);
  }
}

TEST(CrossEntropyLossTest, MetaValidatesShapes) {
  ASSERT_OK_AND_ASSIGN(Tensor logits,
                       Tensor::Empty({2, 3, 11}, DType::kF32, Device::Meta()));
  ASSERT_OK_AND_ASSIGN(Tensor t,
                       Tensor::Empty({2, 3}, DType::kI32, Device::Meta()));
  CrossEntropyLoss loss;
  ASSERT_OK_AND_ASSIGN(float value, loss.Forward(logits, t));
  EXPECT_EQ(value, 0.0f);
  ASSERT_OK_AND_ASSIGN(Tensor dlogits, loss.Backward());
  EXPECT_TRUE(dlogits.is_meta());
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
