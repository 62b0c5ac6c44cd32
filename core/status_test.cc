// Tests for FSDPP_RETURN_IF_ERROR / FSDPP_ASSIGN_OR_RETURN / Annotate.
#include "core/status.h"

#include <memory>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

absl::Status FailIf(bool fail) {
  return fail ? absl::InvalidArgumentError("bad") : absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(bool fail, int value) {
  if (fail) return absl::NotFoundError("no int");
  return std::make_unique<int>(value);
}

int calls = 0;

absl::Status Chain(bool fail_first, bool fail_second) {
  ++calls;
  FSDPP_RETURN_IF_ERROR(FailIf(fail_first));
  ++calls;
  FSDPP_RETURN_IF_ERROR(FailIf(fail_second));
  ++calls;
  return absl::OkStatus();
}

absl::StatusOr<int> Sum(bool fail_a, bool fail_b) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<int> a, MakeInt(fail_a, 2));
  FSDPP_ASSIGN_OR_RETURN(auto b, MakeInt(fail_b, 3));  // Move-only values work.
  return *a + *b;
}

TEST(StatusTest, ReturnIfErrorStopsAtFirstError) {
  calls = 0;
  EXPECT_TRUE(Chain(false, false).ok());
  EXPECT_EQ(calls, 3);
  calls = 0;
  absl::Status s = Chain(false, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(calls, 2);
  calls = 0;
  EXPECT_FALSE(Chain(true, false).ok());
  EXPECT_EQ(calls, 1);
}

TEST(StatusTest, AssignOrReturn) {
  absl::StatusOr<int> ok = Sum(false, false);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 5);
  absl::StatusOr<int> bad = Sum(false, true);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(bad.status().message(), "no int");
}

TEST(StatusTest, AnnotateKeepsCode) {
  absl::Status s = Annotate(absl::DataLossError("crc mismatch"), "file a.bin");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "file a.bin: crc mismatch");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

}  // namespace
}  // namespace fsdpp
