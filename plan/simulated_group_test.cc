// SimulatedProcessGroup records each op (kind, group, size, bytes) and
// completes it at once; an uneven all-to-all as "all_to_all_v" with its
// buffers' bytes, like the even one. It counts the scratch of the backend it
// stands for: Gloo's ring buffers over TCP, none through shared memory.
#include "plan/simulated_group.h"

#include <cstdint>
#include <vector>

#include "comm/gloo_backend.h"
#include "core/allocator.h"
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

TEST(SimulatedGroupTest, ReduceScatterHoldsRingBuffersOnlyOverTcp) {
  int64_t held[2] = {0, 0};
  const SimulatedBackend backends[2] = {SimulatedBackend::kGloo,
                                        SimulatedBackend::kGlooSharedMemory};
  for (int b = 0; b < 2; ++b) {
    MetaAccountant accountant;
    ScopedMetaAccounting scope(&accountant);
    SimulatedProcessGroup group("g", 0, 2, nullptr, backends[b]);
    const Buffer in{nullptr, 1001, DType::kBF16, Device::DryRun()};
    const Buffer out{nullptr, 501, DType::kBF16, Device::DryRun()};
    ASSERT_TRUE(group.ReduceScatter(in, out, ReduceOp::kSum).ok());
    const GlooScratch expected =
        GlooReduceScatterScratch(1001, DType::kBF16, DType::kBF16, 501, 2,
                                 backends[b] != SimulatedBackend::kGloo);
    const MemoryStats stats = accountant.Stats();
    held[b] = stats.current_of(MemoryTag::kCommBuffers);
    EXPECT_EQ(held[b], expected.held) << b;
    // The f32 result of a bf16 output lives during the op on both.
    EXPECT_EQ(stats.peak_of(MemoryTag::kCommBuffers), expected.held + 501 * 4)
        << b;
  }
  EXPECT_EQ(held[0], 3 * 501 * 4);  // the ring's three f32 chunks
  EXPECT_EQ(held[1], 0);
}

}  // namespace
}  // namespace plan
}  // namespace fsdpp
