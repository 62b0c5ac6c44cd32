// Tests for host byte copies and the errors for devices without bytes.
#include "core/memcpy.h"

#include <vector>

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
