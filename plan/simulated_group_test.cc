// SimulatedProcessGroup records each op (kind, group, size, bytes) and
// completes it at once; an uneven all-to-all as "all_to_all_v" with its
// buffers' bytes, like the even one. It counts the scratch of the backend it
// stands for: Gloo's ring buffers over TCP, none through shared memory,
// and the all-gathers into runs and reduce-scatters of spans only there.
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

// Runs and spans as the backend stands: through shared memory only (TCP and
// NCCL say Unimplemented), recorded as the all-gather and reduce-scatter of
// their payload, the spans' reduce-scatter with a one-buffer input's scratch.
TEST(SimulatedGroupTest, RunsAndSpansOnlyThroughSharedMemory) {
  const Buffer gathered{nullptr, 40, DType::kBF16, Device::DryRun()};
  const std::vector<std::vector<BufferRun>> runs = {{{0, 10}, {20, 5}},
                                                    {{10, 10}, {25, 7}}};
  const Buffer reduced{nullptr, 17, DType::kF32, Device::DryRun()};
  const std::vector<std::vector<BufferSpan>> spans = {{{nullptr, 15}},
                                                      {{nullptr, 17}}};
  for (SimulatedBackend backend :
       {SimulatedBackend::kGloo, SimulatedBackend::kNccl}) {
    SimulatedProcessGroup group("g", 1, 2, nullptr, backend);
    EXPECT_FALSE(group.AllGathersRuns());
    EXPECT_FALSE(group.ReduceScattersSpans());
    EXPECT_EQ(group.AllGatherRuns(gathered, runs).status().code(),
              absl::StatusCode::kUnimplemented);
    EXPECT_EQ(
        group.ReduceScatterSpans(DType::kBF16, spans, reduced, ReduceOp::kSum)
            .status()
            .code(),
        absl::StatusCode::kUnimplemented);
  }
  SimulatedOpLog log;
  MetaAccountant accountant;
  ScopedMetaAccounting scope(&accountant);
  SimulatedProcessGroup group("g", 1, 2, &log,
                              SimulatedBackend::kGlooSharedMemory);
  ASSERT_TRUE(group.AllGathersRuns() && group.ReduceScattersSpans());
  ASSERT_TRUE(group.AllGatherRuns(gathered, runs).ok());
  ASSERT_TRUE(
      group.ReduceScatterSpans(DType::kBF16, spans, reduced, ReduceOp::kAvg)
          .ok());
  const std::vector<SimulatedOp> ops = log.ops();
  ASSERT_EQ(ops.size(), 2u);
  EXPECT_EQ(ops[0].kind, "all_gather");
  EXPECT_EQ(ops[0].in_bytes, 17 * 2);  // this rank's runs
  EXPECT_EQ(ops[0].out_bytes, 32 * 2);
  EXPECT_EQ(ops[1].kind, "reduce_scatter");
  EXPECT_EQ(ops[1].in_bytes, 32 * 2);
  EXPECT_EQ(ops[1].out_bytes, 17 * 4);
  const GlooScratch expected = GlooReduceScatterScratch(
      32, DType::kBF16, DType::kF32, 17, 2, /*shared_memory=*/true);
  EXPECT_EQ(accountant.Stats().current_of(MemoryTag::kCommBuffers),
            expected.held);
  // Checked as the real backend checks: this rank's spans fill its output.
  EXPECT_EQ(group
                .ReduceScatterSpans(DType::kBF16, {{{nullptr, 15}}, {}},
                                    reduced, ReduceOp::kSum)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
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
