// Tests for CUDA streams, events and allocators. They need a GPU and skip,
// visibly, without one (the target builds only under --config=cuda).
#include "core/cuda_runtime.h"

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

class CudaRuntimeTest : public testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: skipped";
  }
};

TEST_F(CudaRuntimeTest, StreamEventOrdering) {
  auto a = CudaStream::Create(0, "a");
  auto b = CudaStream::Create(0, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  std::shared_ptr<Event> e = (*a)->Record();
  (*b)->WaitEvent(e);
  ASSERT_TRUE((*b)->Synchronize(absl::Seconds(30)).ok());
  EXPECT_TRUE(e->IsCompleted());
  // A CUDA stream waiting on a CPU stream's event.
  CpuStream host("host");
  (*a)->WaitEvent(host.Record());
  EXPECT_TRUE((*a)->Synchronize(absl::Seconds(30)).ok());
}

TEST_F(CudaRuntimeTest, CachingAllocatorAccounts) {
  ASSERT_GT(RegisterCudaAllocators(), 0);
  Allocator* alloc = GetAllocator(Device::Cuda(0));
  ASSERT_NE(alloc, nullptr);
  int64_t before = alloc->Stats().current_of(MemoryTag::kParams);
  void* p = *alloc->Allocate(12345, MemoryTag::kParams);
  EXPECT_EQ(alloc->Stats().current_of(MemoryTag::kParams), before + 12345);
  alloc->Deallocate(p, 12345, MemoryTag::kParams);
  EXPECT_EQ(alloc->Stats().current_of(MemoryTag::kParams), before);
}

}  // namespace
}  // namespace fsdpp
