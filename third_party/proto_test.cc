// The cc_proto macro produces code that compiles and links against the system
// protobuf runtime: a message round-trips through its wire format.
#include "gtest/gtest.h"
#include "third_party/proto_example.pb.h"

namespace {

TEST(ProtoTest, RoundTripThroughWireFormat) {
  fsdpp::testing::Example in;
  in.set_name("layers.0.attn.wq.weight");
  in.add_shape(768);
  in.add_shape(2304);
  in.set_payload(std::string("\0\1\2", 3));
  std::string wire;
  ASSERT_TRUE(in.SerializeToString(&wire));
  fsdpp::testing::Example out;
  ASSERT_TRUE(out.ParseFromString(wire));
  EXPECT_EQ(out.name(), in.name());
  ASSERT_EQ(out.shape_size(), 2);
  EXPECT_EQ(out.shape(1), 2304);
  EXPECT_EQ(out.payload(), in.payload());
  EXPECT_FALSE(out.ParseFromString("\xff\xff\xff"));
}

}  // namespace
