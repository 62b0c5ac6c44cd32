// What a process learns of its GPUs: in a CPU build none, with errors that
// say how to get one; with a GPU build on a machine without GPUs, the same
// refusals naming the count; on a GPU machine, names and selection.
#include "core/gpus.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(GpusTest, CountAndRefusals) {
  const int count = GpuCount();
  EXPECT_GE(count, 0);
  if (!BuiltWithCuda()) {
    EXPECT_EQ(count, 0);
  }
  const absl::Status missing = UseGpu(count);  // one past the last
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(missing.message(), BuiltWithCuda()
                                                       ? "is not there"
                                                       : "built without CUDA"))
      << missing;
  EXPECT_FALSE(GpuName(-1).ok());
}

TEST(GpusTest, NamesAndSelectionOnAGpu) {
  if (GpuCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  absl::StatusOr<std::string> name = GpuName(0);
  ASSERT_TRUE(name.ok()) << name.status();
  EXPECT_FALSE(name->empty());
  EXPECT_TRUE(UseGpu(0).ok());
}

}  // namespace
}  // namespace fsdpp
