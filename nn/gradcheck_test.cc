// The gradient checker itself: it must reject a slightly wrong input
// gradient, a slightly wrong parameter gradient and gradients that overwrite
// instead of accumulating.
#include "nn/gradcheck.h"

#include "gtest/gtest.h"
#include "nn/linear.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::RandomTensor;
using testing_util::CheckGradients;
using testing_util::Materialize;

enum class Bug { kNone, kDx, kWeightGrad, kOverwrite };

// A Linear with a deliberate backward bug.
class BuggyLinear : public Linear {
 public:
  explicit BuggyLinear(Bug bug) : Linear(5, 7), bug_(bug) {}

 protected:
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override {
    if (bug_ == Bug::kOverwrite) {
      absl::Status s = ZeroGrad();
      if (!s.ok()) return s;
    }
    absl::StatusOr<Tensor> dx = Linear::BackwardImpl(dy);
    if (!dx.ok()) return dx;
    if (bug_ == Bug::kDx) {
      absl::Status s = Scale(*dx, 1.01f, &*dx);
      if (!s.ok()) return s;
    }
    if (bug_ == Bug::kWeightGrad) {
      absl::Status s = Scale(weight()->grad, 1.01f, &weight()->grad);
      if (!s.ok()) return s;
    }
    return dx;
  }

 private:
  Bug bug_;
};

TEST(GradCheckTest, DetectsBugs) {
  const Tensor x = RandomTensor({2, 3, 5}, DType::kF32, 1);
  for (Bug bug : {Bug::kNone, Bug::kDx, Bug::kWeightGrad, Bug::kOverwrite}) {
    BuggyLinear linear(bug);
    ASSERT_OK(Materialize(linear, 2));
    const ::testing::AssertionResult r = CheckGradients(linear, x);
    EXPECT_EQ(static_cast<bool>(r), bug == Bug::kNone)
        << static_cast<int>(bug) << ": " << r.message();
  }
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
