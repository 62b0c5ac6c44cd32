// SimulatedProcessGroup records each op (kind, group, size, bytes) and
// completes it at once; an uneven all-to-all as "all_to_all_v" with its
// buffers' bytes, like the even one.
#include "plan/simulated_group.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace plan {
namespace {

TEST(SimulatedGroupTest, RecordsAllToAllVWithItsBuffersBytes) {
  SimulatedOpLog log;
  SimulatedProcessGroup group("train/ep", 1, 3, &log);
  const Buffer in{nullptr, 7, DType::kBF16, Device::DryRun()};
  const Buffer out{nullptr, 5, DType::kBF16, Device::DryRun()};
  auto work = group.AllToAllV(in, {2, 0, 5}, out, {1, 0, 4});
  ASSERT_TRUE(work.ok()) << work.status();
  EXPECT_TRUE((*work)->IsCompleted());
  auto even = group.AllToAll(in, in);
  ASSERT_TRUE(even.ok()) << even.status();
  const std::vector<SimulatedOp> ops = log.ops();
  ASSERT_EQ(ops.size(), 2u);
  EXPECT_EQ(ops[0].kind, "all_to_all_v");
  EXPECT_EQ(ops[0].group, "train/ep");
  EXPECT_EQ(ops[0].group_size, 3);
  EXPECT_EQ(ops[0].in_bytes, 14);
  EXPECT_EQ(ops[0].out_bytes, 10);
  EXPECT_EQ(ops[1].kind, "all_to_all");
  EXPECT_EQ(ops[1].in_bytes, 14);
}

}  // namespace
}  // namespace plan
}  // namespace fsdpp
