// LinearCrossEntropy: the fused head's mean loss, dx and dW against the
// unfused Linear + CrossEntropyLoss (f32 and bf16, any chunk, ignored
// targets, a backward scale, accumulation onto existing gradients), central
// differences of the fused loss, the automatic rule, all-ignored targets,
// meta tensors, and refusals.
#include "nn/linear_cross_entropy.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "nn/gradcheck.h"
#include "nn/loss.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::AllClose;
using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using testing_util::Materialize;

constexpr int64_t kIgnore = -100;

struct Result {
  float loss = 0;
  int64_t count = 0;
  std::vector<double> dx, dw;
};

// Loss, dx and the weight's gradient (added onto `prior` * 1) of one forward
// and backward, fused with `chunk` (0: the unfused Linear + CrossEntropyLoss).
Result RunHead(LinearCrossEntropy& head, const Tensor& x, const Tensor& targets,
               int64_t chunk, float scale, const Tensor& prior) {
  Result r;
  EXPECT_TRUE(head.ZeroGrad().ok());
  if (prior.defined()) {
    EXPECT_TRUE(head.weight()->EnsureGrad().ok());
    EXPECT_TRUE(Copy(prior, &head.weight()->grad).ok());
  }
  Tensor dx;
  if (chunk == 0) {
    absl::StatusOr<Tensor> logits = head.Forward(x);
    EXPECT_TRUE(logits.ok()) << logits.status();
    EXPECT_FALSE(head.last_forward_fused());
    CrossEntropyLoss loss(kIgnore);
    absl::StatusOr<float> value = loss.Forward(*logits, targets);
    EXPECT_TRUE(value.ok()) << value.status();
    r.loss = *value;
    r.count = loss.count();
    absl::StatusOr<Tensor> dlogits = loss.Backward(scale);
    EXPECT_TRUE(dlogits.ok());
    absl::StatusOr<Tensor> d = head.Backward(*dlogits);
    EXPECT_TRUE(d.ok()) << d.status();
    dx = *d;
  } else {
    EXPECT_TRUE(head.ArmLoss(targets, kIgnore, chunk).ok());
    absl::StatusOr<Tensor> sum = head.Forward(x);
    EXPECT_TRUE(sum.ok()) << sum.status();
    EXPECT_TRUE(head.last_forward_fused());
    EXPECT_EQ(sum->shape(), (Shape{1}));
    r.count = head.count();
    r.loss =
        r.count == 0 ? 0.0f : static_cast<float>(Values(*sum)[0] / r.count);
    head.set_backward_scale(scale);
    absl::StatusOr<Tensor> d = head.Backward(Tensor());
    EXPECT_TRUE(d.ok()) << d.status();
    EXPECT_FALSE(head.fused_pending());
    dx = *d;
  }
  EXPECT_EQ(dx.shape(), x.shape());
  r.dx = Values(dx);
  r.dw = Values(head.weight()->grad);
  return r;
}

Tensor Targets(const Shape& shape, int64_t vocab, bool with_ignored) {
  std::vector<int64_t> t;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  for (int64_t i = 0; i < n; ++i) {
    t.push_back(with_ignored && i % 4 == 1 ? kIgnore : (i * 7 + 3) % vocab);
  }
  return *Tensor::FromInts(shape, t, DType::kI64);
}

TEST(LinearCrossEntropyTest, F32EqualsTheUnfusedHeadForEveryChunk) {
  const int64_t in = 6, vocab = 13;
  LinearCrossEntropy head(in, vocab, false, 0.5f);
  ASSERT_OK(Materialize(head, 3));
  const Tensor x = RandomTensor({2, 5, in}, DType::kF32, 4);
  const Tensor targets = Targets({2, 5}, vocab, true);
  const Tensor prior = RandomTensor({vocab, in}, DType::kF32, 5);
  const Result ref = RunHead(head, x, targets, 0, 0.5f, prior);
  EXPECT_EQ(ref.count, 7);
  for (int64_t chunk : {1, 3, 4, 10, 64}) {
    SCOPED_TRACE(chunk);
    const Result fused = RunHead(head, x, targets, chunk, 0.5f, prior);
    EXPECT_EQ(fused.count, ref.count);
    EXPECT_NEAR(fused.loss, ref.loss, 1e-6 * std::abs(ref.loss));
    EXPECT_TRUE(AllClose(fused.dx, ref.dx, 1e-5, 1e-7));
    EXPECT_TRUE(AllClose(fused.dw, ref.dw, 1e-5, 1e-7));
  }
}

TEST(LinearCrossEntropyTest, Bf16CloseToTheUnfusedHead) {
  const int64_t in = 16, vocab = 40;
  LinearCrossEntropy head(in, vocab, false, 0.5f, DType::kBF16);
  ASSERT_OK(Materialize(head, 6));
  const Tensor x = RandomTensor({3, 8, in}, DType::kBF16, 7);
  const Tensor targets = Targets({3, 8}, vocab, true);
  const Result ref = RunHead(head, x, targets, 0, 1.0f, Tensor());
  const Result fused = RunHead(head, x, targets, 5, 1.0f, Tensor());
  EXPECT_NEAR(fused.loss, ref.loss, 1e-3 * std::abs(ref.loss));
  // dx rounds once to bf16 either way; dW additionally once per chunk.
  EXPECT_TRUE(AllClose(fused.dx, ref.dx, 2e-2, 1e-4));
  EXPECT_TRUE(AllClose(fused.dw, ref.dw, 4e-2, 1e-3));
}

// Central differences of the fused mean loss (f32) against its dx and dW.
TEST(LinearCrossEntropyTest, FiniteDifferenceGradients) {
  const int64_t in = 4, vocab = 9;
  LinearCrossEntropy head(in, vocab, false, 0.5f);
  ASSERT_OK(Materialize(head, 8));
  Tensor x = RandomTensor({6, in}, DType::kF32, 9);
  const Tensor targets = Targets({6}, vocab, true);
  const Result r = RunHead(head, x, targets, 4, 1.0f, Tensor());
  auto loss = [&]() {
    EXPECT_TRUE(head.ArmLoss(targets, kIgnore, 4).ok());
    absl::StatusOr<Tensor> sum = head.Forward(x);
    EXPECT_TRUE(sum.ok());
    const double value = Values(*sum)[0] / head.count();
    head.ReleaseSavedTensors();
    return value;
  };
  const double h = 1e-3;
  for (Tensor* t : {&x, &head.weight()->data}) {
    const std::vector<double>& analytic = t == &x ? r.dx : r.dw;
    std::vector<double> numeric(t->numel());
    float* p = t->data<float>();
    for (int64_t i = 0; i < t->numel(); ++i) {
      const float keep = p[i];
      p[i] = keep + h;
      const double up = loss();
      p[i] = keep - h;
      const double down = loss();
      p[i] = keep;
      numeric[i] = (up - down) / (2 * h);
    }
    EXPECT_TRUE(AllClose(analytic, numeric, 2e-3, 2e-4));
  }
}

TEST(LinearCrossEntropyTest, AutomaticChunkRunsFusedOnlyWhereItSavesMemory) {
  EXPECT_EQ(LinearCrossEntropy::AutoChunkRows(50304, DType::kBF16), 1328);
  EXPECT_EQ(LinearCrossEntropy::AutoChunkRows(50304, DType::kF32), 656);
  EXPECT_EQ(LinearCrossEntropy::AutoChunkRows(int64_t{1} << 30, DType::kF32),
            16);
  // vocab 2^16 f32: chunks of at most 512 rows; fused from 512 + in + 1
  // rows.
  const int64_t in = 2, vocab = int64_t{1} << 16;
  LinearCrossEntropy head(in, vocab, false, 0.5f);
  ASSERT_OK(Materialize(head, 10));
  for (int64_t rows : {int64_t{514}, int64_t{515}}) {
    const Tensor x = RandomTensor({rows, in}, DType::kF32, 11);
    ASSERT_OK(head.ArmLoss(Targets({rows}, vocab, false), kIgnore,
                           LinearCrossEntropy::kAutoChunk));
    ASSERT_OK_AND_ASSIGN(Tensor out, head.Forward(x));
    EXPECT_EQ(head.last_forward_fused(), rows == 515);
    const Shape expected = rows == 515 ? Shape{1} : Shape{rows, vocab};
    EXPECT_EQ(out.shape(), expected);
    head.ReleaseSavedTensors();
    EXPECT_FALSE(head.fused_pending());
  }
}

TEST(LinearCrossEntropyTest, AllIgnoredGivesZeroLossAndZeroGradients) {
  LinearCrossEntropy head(3, 5, false, 0.5f);
  ASSERT_OK(Materialize(head, 12));
  const Tensor x = RandomTensor({4, 3}, DType::kF32, 13);
  ASSERT_OK_AND_ASSIGN(
      Tensor targets,
      Tensor::FromInts({4}, {kIgnore, kIgnore, kIgnore, kIgnore}, DType::kI64));
  const Result r = RunHead(head, x, targets, 3, 1.0f, Tensor());
  EXPECT_EQ(r.count, 0);
  EXPECT_EQ(r.loss, 0.0f);
  for (double v : r.dx) EXPECT_EQ(v, 0.0);
  for (double v : r.dw) EXPECT_EQ(v, 0.0);
}

TEST(LinearCrossEntropyTest, MetaAllocatesLikeARealRun) {
  LinearCrossEntropy head(8, 32, false, 0.5f);
  ASSERT_OK(head.ToEmpty(Device::Meta()));
  ASSERT_OK_AND_ASSIGN(Tensor x,
                       Tensor::Empty({2, 10, 8}, DType::kF32, Device::Meta()));
  ASSERT_OK_AND_ASSIGN(Tensor t,
                       Tensor::Empty({2, 10}, DType::kI64, Device::Meta()));
  ASSERT_OK(head.ArmLoss(t, kIgnore, 4));
  ASSERT_OK_AND_ASSIGN(Tensor sum, head.Forward(x));
  EXPECT_TRUE(sum.is_meta());
  EXPECT_TRUE(head.fused_pending());
  ASSERT_OK_AND_ASSIGN(Tensor dx, head.Backward(Tensor()));
  EXPECT_EQ(dx.shape(), x.shape());
}

TEST(LinearCrossEntropyTest, Refusals) {
  LinearCrossEntropy biased(3, 5, true, 0.5f);
  EXPECT_FALSE(biased.CanFuseLoss());
  ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::FromInts({2}, {1, 2}, DType::kI64));
  EXPECT_EQ(biased.ArmLoss(t, kIgnore, 4).code(),
            absl::StatusCode::kFailedPrecondition);

  LinearCrossEntropy head(3, 5, false, 0.5f);
  ASSERT_OK(Materialize(head, 14));
  EXPECT_EQ(head.ArmLoss(t, kIgnore, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(head.ArmLoss(RandomTensor({2}, DType::kF32, 1), kIgnore, 4).code(),
            absl::StatusCode::kInvalidArgument);
  // Three rows, two targets: refused, and the arming is used up.
  ASSERT_OK(head.ArmLoss(t, kIgnore, 4));
  const Tensor x = RandomTensor({3, 3}, DType::kF32, 15);
  absl::StatusOr<Tensor> bad = head.Forward(x);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("one target per row"),
            std::string::npos)
      << bad.status();
  EXPECT_FALSE(head.fused_pending());
  ASSERT_OK_AND_ASSIGN(Tensor logits, head.Forward(x));
  EXPECT_EQ(logits.shape(), (Shape{3, 5}));
  // A bad backward scale.
  ASSERT_OK(
      head.ArmLoss(*Tensor::FromInts({3}, {1, 2, 3}, DType::kI64), kIgnore, 2));
  ASSERT_OK(head.Forward(x).status());
  head.set_backward_scale(0.0f);
  EXPECT_EQ(head.Backward(Tensor()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
