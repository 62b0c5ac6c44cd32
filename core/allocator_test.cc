// Tests for exact tagged memory accounting and the CPU allocator.
#include "core/allocator.h"

#include <cstdint>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(AllocatorTest, ExactAccountingPerTag) {
  CpuAllocator alloc;
  void* a = *alloc.Allocate(1000, MemoryTag::kParams);
  void* b = *alloc.Allocate(333, MemoryTag::kGrads);
  void* c = *alloc.Allocate(4096, MemoryTag::kParams);
  MemoryStats s = alloc.Stats();
  EXPECT_EQ(s.current_of(MemoryTag::kParams), 5096);
  EXPECT_EQ(s.current_of(MemoryTag::kGrads), 333);
  EXPECT_EQ(s.current_of(MemoryTag::kOptimizerState), 0);
  EXPECT_EQ(s.total_current, 5429);
  EXPECT_EQ(s.total_peak, 5429);
  EXPECT_EQ(s.num_allocations, 3);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);

  alloc.Deallocate(c, 4096, MemoryTag::kParams);
  s = alloc.Stats();
  EXPECT_EQ(s.current_of(MemoryTag::kParams), 1000);
  EXPECT_EQ(s.peak_of(MemoryTag::kParams), 5096);
  EXPECT_EQ(s.total_current, 1333);
  EXPECT_EQ(s.total_peak, 5429);

  alloc.ResetPeak();
  s = alloc.Stats();
  EXPECT_EQ(s.peak_of(MemoryTag::kParams), 1000);
  EXPECT_EQ(s.total_peak, 1333);
  void* d = *alloc.Allocate(10, MemoryTag::kActivations);
  EXPECT_EQ(alloc.Stats().total_peak, 1343);
  EXPECT_EQ(alloc.Stats().peak_of(MemoryTag::kActivations), 10);
  alloc.Deallocate(a, 1000, MemoryTag::kParams);
  alloc.Deallocate(b, 333, MemoryTag::kGrads);
  alloc.Deallocate(d, 10, MemoryTag::kActivations);
  s = alloc.Stats();
  EXPECT_EQ(s.total_current, 0);
  EXPECT_EQ(s.num_allocations, 0);
  EXPECT_NE(s.ToString().find("activations"), std::string::npos);
}

TEST(AllocatorTest, ZeroBytesAllocatesNothing) {
  CpuAllocator alloc;
  absl::StatusOr<void*> p = alloc.Allocate(0, MemoryTag::kOther);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, nullptr);
  EXPECT_EQ(alloc.Stats().total_current, 0);
  EXPECT_EQ(alloc.Stats().num_allocations, 0);
}

TEST(AllocatorTest, LimitGivesResourceExhaustedWithDetails) {
  CpuAllocator alloc(/*limit_bytes=*/1000);
  void* a = *alloc.Allocate(600, MemoryTag::kParams);
  absl::StatusOr<void*> b = alloc.Allocate(500, MemoryTag::kCommBuffers);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("500 bytes for comm"),
            absl::string_view::npos)
      << b.status();
  EXPECT_EQ(alloc.Stats().total_current, 600);  // The failure counted nothing.
  alloc.Deallocate(a, 600, MemoryTag::kParams);
}

TEST(AllocatorTest, ConcurrentAccountingIsExact) {
  CpuAllocator alloc;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&alloc, t] {
      for (int i = 0; i < 2000; ++i) {
        size_t n = 1 + (i * 7 + t) % 300;
        MemoryTag tag = static_cast<MemoryTag>((i + t) % kNumMemoryTags);
        void* p = *alloc.Allocate(n, tag);
        alloc.Deallocate(p, n, tag);
      }
    });
  }
  for (auto& t : threads) t.join();
  MemoryStats s = alloc.Stats();
  EXPECT_EQ(s.total_current, 0);
  EXPECT_EQ(s.num_allocations, 0);
  for (int i = 0; i < kNumMemoryTags; ++i) EXPECT_EQ(s.current[i], 0);
}

TEST(AllocatorTest, RegistryHasCpuAndNoMeta) {
  ASSERT_NE(GetAllocator(Device::Cpu()), nullptr);
  EXPECT_EQ(GetAllocator(Device::Meta()), nullptr);
  CpuAllocator mine;
  Allocator* previous = SetAllocator(&mine);
  EXPECT_EQ(GetAllocator(Device::Cpu()), &mine);
  EXPECT_EQ(SetAllocator(previous), &mine);
  EXPECT_EQ(GetAllocator(Device::Cpu()), previous);
}

TEST(AllocatorDeathTest, FreeingMoreThanAllocatedIsAProgrammerError) {
  CpuAllocator alloc;
  void* p = *alloc.Allocate(8, MemoryTag::kGrads);
  EXPECT_DEATH(alloc.Deallocate(p, 16, MemoryTag::kGrads),
               "freeing more grads bytes than allocated");
  alloc.Deallocate(p, 8, MemoryTag::kGrads);
}

}  // namespace
}  // namespace fsdpp
