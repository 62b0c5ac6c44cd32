// Tests for Device parsing and printing.
#include "core/device.h"

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(DeviceTest, ParseAndPrintRoundTrip) {
  for (const char* text : {"cpu", "meta", "cuda:0", "cuda:13"}) {
    absl::StatusOr<Device> d = Device::Parse(text);
    ASSERT_TRUE(d.ok()) << text;
    EXPECT_EQ(d->ToString(), text);
  }
  EXPECT_EQ(*Device::Parse("cuda"), Device::Cuda(0));
  EXPECT_TRUE(Device::Parse("meta")->is_meta());
  EXPECT_TRUE(Device::Parse("cpu")->is_cpu());
  EXPECT_EQ(Device::Parse("cuda:2")->index(), 2);
}

TEST(DeviceTest, BadInputNamesTheText) {
  for (const char* text : {"gpu", "cuda:", "cuda:-1", "cuda:x", "", "CPU"}) {
    absl::StatusOr<Device> d = Device::Parse(text);
    ASSERT_FALSE(d.ok()) << text;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find(std::string("'") + text + "'"),
              absl::string_view::npos)
        << d.status();
  }
}

TEST(DeviceTest, Equality) {
  EXPECT_EQ(Device::Cuda(1), Device(DeviceType::kCuda, 1));
  EXPECT_NE(Device::Cuda(1), Device::Cuda(0));
  EXPECT_NE(Device::Cpu(), Device::Meta());
}

}  // namespace
}  // namespace fsdpp
