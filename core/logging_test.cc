// Tests for LOG / CHECK.
#include "core/logging.h"

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(LoggingTest, CheckPassesSilently) {
  int evaluated = 0;
  CHECK(++evaluated == 1) << "never printed";
  CHECK_EQ(evaluated, 1);
  CHECK_LT(1, 2);
  CHECK_GE(2, 2);
  CHECK_OK(absl::OkStatus());
  EXPECT_EQ(evaluated, 1);  // The condition is evaluated once.
}

TEST(LoggingDeathTest, CheckFailureAbortsWithMessage) {
  EXPECT_DEATH(CHECK(1 + 1 == 3) << "math is broken",
               "Check failed: 1 \\+ 1 == 3 math is broken");
  int a = 4, b = 5;
  EXPECT_DEATH(CHECK_EQ(a, b) << "sizes", "a == b \\(4 vs. 5\\) sizes");
  EXPECT_DEATH(CHECK_OK(absl::InternalError("boom")), "INTERNAL: boom");
  EXPECT_DEATH(LOG(FATAL) << "fatal here", "fatal here");
}

TEST(LoggingDeathTest, PrefixAndLevel) {
  // The prefix appears in the line; messages below the level are dropped.
  EXPECT_DEATH(
      {
        SetLogPrefix("[rank 7] ");
        LOG(FATAL) << "x";
      },
      "\\] \\[rank 7\\] x");
  SetLogPrefix("");
  SetMinLogLevel(LogSeverity::kError);
  EXPECT_EQ(MinLogLevel(), LogSeverity::kError);
  testing::internal::CaptureStderr();
  LOG(INFO) << "hidden";
  LOG(ERROR) << "shown";
  std::string err = testing::internal::GetCapturedStderr();
  SetMinLogLevel(LogSeverity::kInfo);
  EXPECT_EQ(err.find("hidden"), std::string::npos);
  EXPECT_NE(err.find("shown"), std::string::npos);
  EXPECT_EQ(err[0], 'E');
}

}  // namespace
}  // namespace fsdpp
