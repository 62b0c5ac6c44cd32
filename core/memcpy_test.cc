// Tests for host byte copies, the errors for devices without bytes, and
// device_wait's host-side behaviour (its GPU paths run in the CUDA tests).
#include "core/memcpy.h"

#include <vector>

#include "core/device_wait.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(MemcpyTest, HostCopyAndZero) {
  std::vector<char> a = {1, 2, 3, 4, 5}, b(5, 9);
  ASSERT_TRUE(
      CopyBytes(b.data(), Device::Cpu(), a.data(), Device::Cpu(), 5).ok());
  EXPECT_EQ(a, b);
  ASSERT_TRUE(ZeroBytes(b.data() + 1, Device::Cpu(), 3).ok());
  EXPECT_EQ(b, (std::vector<char>{1, 0, 0, 0, 5}));
  // Overlapping ranges behave like memmove.
  ASSERT_TRUE(
      CopyBytes(a.data() + 1, Device::Cpu(), a.data(), Device::Cpu(), 4).ok());
  EXPECT_EQ(a, (std::vector<char>{1, 1, 2, 3, 4}));
}

// To a host destination the staged copy is a plain copy; the source may be
// reused at once. Host copies count no host sync (there is no GPU to wait
// for).
TEST(MemcpyTest, StagedCopyToTheHostIsACopy) {
  std::vector<char> a = {1, 2, 3}, b(3, 0);
  const int64_t syncs = HostSyncCount();
  ASSERT_TRUE(
      CopyBytesFromHostAsync(b.data(), Device::Cpu(), a.data(), 3).ok());
  a.assign(3, 9);
  EXPECT_EQ(b, (std::vector<char>{1, 2, 3}));
  EXPECT_EQ(HostSyncCount(), syncs);
}

TEST(DeviceWaitTest, CountsAndRefusesNonGpuWaits) {
  const int64_t before = HostSyncCount();
  CountHostSync();
  EXPECT_EQ(HostSyncCount(), before + 1);
  int event = 0;
  absl::Status s = ComputeStreamWaitEvent(Device::Cpu(), &event);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("needs a CUDA device"), absl::string_view::npos)
      << s;
  s = ComputeStreamWaitEvent(Device::Cuda(0), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST(MemcpyTest, MetaHasNoBytes) {
  char x = 0;
  absl::Status s = CopyBytes(&x, Device::Cpu(), &x, Device::Meta(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("between meta and cpu"), absl::string_view::npos)
      << s;
  EXPECT_TRUE(CopyBytes(&x, Device::Cpu(), &x, Device::Meta(), 0).ok());
  // Between meta buffers (a dry run) and zeroing one: nothing to do, and
  // nothing is touched.
  char y = 7;
  EXPECT_TRUE(CopyBytes(&y, Device::DryRun(), &x, Device::Meta(), 1).ok());
  EXPECT_TRUE(ZeroBytes(&y, Device::Meta(), 1).ok());
  EXPECT_EQ(y, 7);
}

}  // namespace
}  // namespace fsdpp
