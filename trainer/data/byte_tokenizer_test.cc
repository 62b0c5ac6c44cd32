// Tests of the byte-level tokenizer.
#include "trainer/data/byte_tokenizer.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace trainer {
namespace {

using ::testing::ElementsAre;

TEST(ByteTokenizerTest, BytesRoundTrip) {
  const ByteTokenizer tokenizer;
  EXPECT_EQ(tokenizer.name(), "byte");
  EXPECT_EQ(tokenizer.vocab_size(), 257);
  EXPECT_EQ(tokenizer.eot_id(), 256);
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::vector<int32_t> ids = tokenizer.Encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  auto decoded = tokenizer.Decode(ids);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, all);
  EXPECT_THAT(tokenizer.Encode("h\xc3\xa9"), ElementsAre('h', 0xC3, 0xA9));
}

TEST(ByteTokenizerTest, EndOfText) {
  const ByteTokenizer tokenizer;
  auto decoded = tokenizer.Decode({'a', 256, 'b'});
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, "a<|endoftext|>b");
  // "<|endoftext|>" in text is ordinary bytes.
  EXPECT_EQ(tokenizer.Encode("<|endoftext|>").size(), 13u);
}

TEST(ByteTokenizerTest, WithoutEndOfText) {
  const ByteTokenizer tokenizer(/*with_eot=*/false);
  EXPECT_EQ(tokenizer.vocab_size(), 256);
  EXPECT_EQ(tokenizer.eot_id(), -1);
  EXPECT_EQ(tokenizer.Decode({'a', 256}).status().message(),
            "byte tokenizer: id 256 at position 1 is outside [0, 256)");
  EXPECT_EQ(ByteTokenizer().Decode({-1}).status().message(),
            "byte tokenizer: id -1 at position 0 is outside [0, 257)");
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
