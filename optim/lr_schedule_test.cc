// LrSchedule against hand-computed values: base 1.0, 4 warmup steps, decay
// over steps [4, 12] to a floor of 0.1.
//   warmup:  step s < 4 gives (s + 1) / 4 = 0.25, 0.5, 0.75, 1.0
//   cosine:  0.1 + 0.9 * 0.5 * (1 + cos(pi * (s - 4) / 8))
//            s=6: 0.1 + 0.45 * (1 + sqrt(2)/2) = 0.86819805153394637
//            s=8: 0.55; s=10: 0.1 + 0.45 * (1 - sqrt(2)/2) = 0.23180194846605
//   linear:  0.1 + 0.9 * (1 - (s - 4) / 8): s=6: 0.775, s=8: 0.55, s=10: 0.325
//   after step 12: the floor 0.1; constant: 1.0 after warmup.
#include "optim/lr_schedule.h"

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

LrScheduleOptions Opts(LrDecay decay) {
  LrScheduleOptions o;
  o.base_lr = 1.0;
  o.warmup_steps = 4;
  o.total_steps = 12;
  o.min_lr_ratio = 0.1;
  o.decay = decay;
  return o;
}

constexpr double kTol = 1e-15;

TEST(LrScheduleTest, Warmup) {
  for (LrDecay d : {LrDecay::kCosine, LrDecay::kLinear, LrDecay::kConstant}) {
    LrSchedule s = *LrSchedule::Create(Opts(d));
    EXPECT_NEAR(s.LrAt(0), 0.25, kTol);
    EXPECT_NEAR(s.LrAt(1), 0.5, kTol);
    EXPECT_NEAR(s.LrAt(2), 0.75, kTol);
    EXPECT_NEAR(s.LrAt(3), 1.0, kTol);
    EXPECT_NEAR(s.LrAt(4), 1.0, kTol);  // Decay starts at its peak.
  }
}

TEST(LrScheduleTest, Cosine) {
  LrSchedule s = *LrSchedule::Create(Opts(LrDecay::kCosine));
  EXPECT_NEAR(s.LrAt(6), 0.86819805153394637, kTol);
  EXPECT_NEAR(s.LrAt(8), 0.55, kTol);
  EXPECT_NEAR(s.LrAt(10), 0.23180194846605363, kTol);
  EXPECT_NEAR(s.LrAt(12), 0.1, kTol);
  EXPECT_NEAR(s.LrAt(13), 0.1, kTol);
  EXPECT_NEAR(s.LrAt(1000000), 0.1, kTol);
}

TEST(LrScheduleTest, Linear) {
  LrSchedule s = *LrSchedule::Create(Opts(LrDecay::kLinear));
  EXPECT_NEAR(s.LrAt(6), 0.775, kTol);
  EXPECT_NEAR(s.LrAt(8), 0.55, kTol);
  EXPECT_NEAR(s.LrAt(10), 0.325, kTol);
  EXPECT_NEAR(s.LrAt(12), 0.1, kTol);
  EXPECT_NEAR(s.LrAt(50), 0.1, kTol);
}

TEST(LrScheduleTest, Constant) {
  LrSchedule s = *LrSchedule::Create(Opts(LrDecay::kConstant));
  EXPECT_EQ(s.LrAt(4), 1.0);
  EXPECT_EQ(s.LrAt(12), 1.0);
  EXPECT_EQ(s.LrAt(1000), 1.0);
}

TEST(LrScheduleTest, NoWarmupAndZeroLengthDecay) {
  LrScheduleOptions o = Opts(LrDecay::kCosine);
  o.warmup_steps = 0;
  o.total_steps = 4;
  o.base_lr = 3e-4;
  o.min_lr_ratio = 0.0;
  LrSchedule s = *LrSchedule::Create(o);
  EXPECT_DOUBLE_EQ(s.LrAt(0), 3e-4);
  EXPECT_NEAR(s.LrAt(2), 1.5e-4, 1e-18);
  EXPECT_EQ(s.LrAt(4), 0.0);
  o.total_steps = 0;  // Decay of length 0: straight to the floor.
  EXPECT_EQ(LrSchedule::Create(o)->LrAt(0), 0.0);
}

TEST(LrScheduleTest, RejectsBadOptions) {
  LrScheduleOptions o = Opts(LrDecay::kCosine);
  o.base_lr = -1;
  EXPECT_FALSE(LrSchedule::Create(o).ok());
  o = Opts(LrDecay::kCosine);
  o.warmup_steps = -1;
  EXPECT_FALSE(LrSchedule::Create(o).ok());
  o = Opts(LrDecay::kLinear);
  o.total_steps = 3;  // Before the end of warmup.
  EXPECT_FALSE(LrSchedule::Create(o).ok());
  o = Opts(LrDecay::kCosine);
  o.min_lr_ratio = 1.5;
  EXPECT_EQ(LrSchedule::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fsdpp
