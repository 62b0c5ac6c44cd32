// Tests for the caching allocator's reuse, accounting and OOM retry, over a
// malloc-backed raw allocator with a byte budget.
#include "core/caching_allocator.h"

#include <cstdlib>
#include <memory>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

class BudgetRaw final : public RawAllocator {
 public:
  explicit BudgetRaw(size_t budget) : budget_(budget) {}
  Device device() const override { return Device::Cuda(0); }
  void* Alloc(size_t bytes) override {
    if (used_ + bytes > budget_) return nullptr;
    used_ += bytes;
    ++allocs;
    void* p = std::malloc(bytes);
    sizes_[p] = bytes;
    return p;
  }
  void Free(void* p) override {
    used_ -= sizes_[p];
    sizes_.erase(p);
    ++frees;
    std::free(p);
  }
  int allocs = 0;
  int frees = 0;

 private:
  size_t budget_;
  size_t used_ = 0;
  absl::flat_hash_map<void*, size_t> sizes_;
};

TEST(CachingAllocatorTest, ReusesFreedBlocks) {
  auto raw = std::make_unique<BudgetRaw>(1 << 20);
  BudgetRaw* r = raw.get();
  CachingAllocator alloc(std::move(raw));
  EXPECT_EQ(alloc.device(), Device::Cuda(0));
  void* a = *alloc.Allocate(3000, MemoryTag::kCommBuffers);
  alloc.Deallocate(a, 3000, MemoryTag::kCommBuffers);
  EXPECT_EQ(alloc.cached_bytes(), 3072);
  // Same rounded size: the same block, no new raw allocation.
  void* b = *alloc.Allocate(3010, MemoryTag::kCommBuffers);
  EXPECT_EQ(a, b);
  EXPECT_EQ(r->allocs, 1);
  EXPECT_EQ(alloc.cached_bytes(), 0);
  // A request less than half the cached block gets a new block.
  alloc.Deallocate(b, 3010, MemoryTag::kCommBuffers);
  void* c = *alloc.Allocate(1000, MemoryTag::kParams);
  EXPECT_NE(c, b);
  EXPECT_EQ(r->allocs, 2);
  MemoryStats s = alloc.Stats();
  EXPECT_EQ(s.total_current, 1000);          // Exact requested bytes...
  EXPECT_EQ(s.reserved_bytes, 3072 + 1024);  // ...and what the device holds.
  EXPECT_EQ(s.peak_of(MemoryTag::kCommBuffers), 3010);
  alloc.Deallocate(c, 1000, MemoryTag::kParams);
  alloc.EmptyCache();
  EXPECT_EQ(r->frees, 2);
  EXPECT_EQ(alloc.Stats().reserved_bytes, 0);
}

TEST(CachingAllocatorTest, SteadyStateNeedsNoNewDeviceAllocations) {
  auto raw = std::make_unique<BudgetRaw>(64 << 20);
  BudgetRaw* r = raw.get();
  CachingAllocator alloc(std::move(raw));
  const size_t sizes[] = {4 << 20, 1 << 20, 3000, 4 << 20};
  for (int step = 0; step < 10; ++step) {
    void* p[4];
    for (int i = 0; i < 4; ++i)
      p[i] = *alloc.Allocate(sizes[i], MemoryTag::kOther);
    for (int i = 0; i < 4; ++i)
      alloc.Deallocate(p[i], sizes[i], MemoryTag::kOther);
  }
  EXPECT_EQ(r->allocs, 4);
}

TEST(CachingAllocatorTest, OomReleasesCacheAndRetries) {
  auto raw = std::make_unique<BudgetRaw>(7000);
  BudgetRaw* r = raw.get();
  CachingAllocator alloc(std::move(raw));
  void* a = *alloc.Allocate(6000, MemoryTag::kActivations);
  alloc.Deallocate(a, 6000, MemoryTag::kActivations);
  // 2000 cannot reuse the 6144-byte block (more than 2x) and the budget is
  // exhausted by the cached block: the cache is released and the retry works.
  void* b = *alloc.Allocate(2000, MemoryTag::kActivations);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(r->frees, 1);
  absl::StatusOr<void*> c = alloc.Allocate(6000, MemoryTag::kGrads);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find(
                "cuda:0: out of memory allocating 6000 bytes for grads"),
            absl::string_view::npos)
      << c.status();
  alloc.Deallocate(b, 2000, MemoryTag::kActivations);
}

TEST(CachingAllocatorTest, RoundSize) {
  EXPECT_EQ(CachingAllocator::RoundSize(1), 512u);
  EXPECT_EQ(CachingAllocator::RoundSize(512), 512u);
  EXPECT_EQ(CachingAllocator::RoundSize(513), 1024u);
}

}  // namespace
}  // namespace fsdpp
