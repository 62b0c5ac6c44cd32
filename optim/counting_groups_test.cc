// CountingProcessGroup forwards every op to the wrapped Gloo group and counts
// it by kind (even and uneven all-to-alls apart), with payload bytes for the
// ring collectives and the bytes uneven all-to-alls send.
#include "optim/counting_groups.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(CountingGroupsTest, CountsEachKindAndForwards) {
  testing_util::RunOnCountingMesh({{"dp", 2}}, [](int rank, DeviceMesh& mesh) {
    ProcessGroup* group = *mesh.Group("dp");
    const testing_util::OpCounts before = testing_util::AxisCounts(mesh, "dp");
    const testing_util::OpBytes before_bytes =
        testing_util::AxisBytes(mesh, "dp");
    // Both ranks send 1 element to rank 0 and 2 to rank 1.
    std::vector<float> in = {10.0f * rank, 10.0f * rank + 1, 10.0f * rank + 2};
    const std::vector<int64_t> in_splits = {1, 2};
    const std::vector<int64_t> out_splits =
        rank == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 2};
    std::vector<float> out(rank == 0 ? 2 : 4, -1.0f);
    const Buffer in_buffer{in.data(), 3, DType::kF32, Device::Cpu()};
    const Buffer out_buffer{out.data(), static_cast<int64_t>(out.size()),
                            DType::kF32, Device::Cpu()};
    auto work = group->AllToAllV(in_buffer, in_splits, out_buffer, out_splits);
    ASSERT_TRUE(work.ok()) << work.status();
    ASSERT_TRUE((*work)->Wait(absl::Seconds(60)).ok());
    if (rank == 0) {
      EXPECT_EQ(out, (std::vector<float>{0, 10}));
    } else {
      EXPECT_EQ(out, (std::vector<float>{1, 2, 11, 12}));
    }
    std::vector<float> even(2, 1.0f), even_out(2);
    ASSERT_TRUE(
        (*group->AllToAll({even.data(), 2, DType::kF32, Device::Cpu()},
                          {even_out.data(), 2, DType::kF32, Device::Cpu()}))
            ->Wait(absl::Seconds(60))
            .ok());
    // A rejected op is counted too.
    EXPECT_FALSE(group->AllToAllV(in_buffer, {3}, out_buffer, out_splits).ok());
    const testing_util::OpCounts counts = testing_util::AxisCounts(mesh, "dp");
    EXPECT_EQ(counts.all_to_all_v - before.all_to_all_v, 2);
    EXPECT_EQ(counts.all_to_all - before.all_to_all, 1);
    EXPECT_EQ(counts.total() - before.total(), 3);
    const testing_util::OpBytes bytes = testing_util::AxisBytes(mesh, "dp");
    EXPECT_EQ(bytes.RingBytesSent(2), 0.0);
    // Rank 0 sent 2 floats to rank 1, rank 1 one float to rank 0; the
    // rejected op sent nothing.
    EXPECT_EQ(bytes.all_to_all_v_sent - before_bytes.all_to_all_v_sent,
              rank == 0 ? 8 : 4);
  });
}

}  // namespace
}  // namespace fsdpp
