// Tests of UTF-8 decoding and the Unicode class tables.
#include "trainer/data/unicode.h"

#include <string>

#include "gtest/gtest.h"

namespace fsdpp {
namespace trainer {
namespace {

int32_t Decode(const std::string& text, int* length) {
  int32_t code_point;
  *length = DecodeUtf8(text, 0, &code_point);
  return code_point;
}

TEST(UnicodeTest, DecodesWellFormedUtf8) {
  int length;
  EXPECT_EQ(Decode("A", &length), 'A');
  EXPECT_EQ(length, 1);
  EXPECT_EQ(Decode("\xc3\xa9", &length), 0xE9);
  EXPECT_EQ(length, 2);
  EXPECT_EQ(Decode("\xe6\x97\xa5", &length), 0x65E5);
  EXPECT_EQ(length, 3);
  EXPECT_EQ(Decode("\xf0\x9f\x99\x82", &length), 0x1F642);
  EXPECT_EQ(length, 4);
  EXPECT_EQ(Decode("\xf4\x8f\xbf\xbf", &length), 0x10FFFF);
  EXPECT_EQ(length, 4);
}

TEST(UnicodeTest, RejectsMalformedUtf8OneByteAtATime) {
  for (const std::string& bad : {
           std::string("\x80"),              // Lone continuation byte.
           std::string("\xc0\x80"),          // Overlong NUL.
           std::string("\xe0\x80\xaf"),      // Overlong '/'.
           std::string("\xed\xa0\x80"),      // Surrogate U+D800.
           std::string("\xf4\x90\x80\x80"),  // Above U+10FFFF.
           std::string("\xe6\x97"),          // Truncated.
           std::string("\xc3"
                       "A"),  // Bad continuation.
           std::string("\xff"),
       }) {
    int length;
    EXPECT_EQ(Decode(bad, &length), kInvalidCodePoint) << bad;
    EXPECT_EQ(length, 1) << bad;
  }
}

TEST(UnicodeTest, Classes) {
  EXPECT_TRUE(IsLetter('a'));
  EXPECT_TRUE(IsLetter(0xE9));     // é
  EXPECT_TRUE(IsLetter(0x65E5));   // 日
  EXPECT_TRUE(IsLetter(0x0436));   // ж
  EXPECT_TRUE(IsLetter(0x20000));  // CJK Extension B
  EXPECT_FALSE(IsLetter('1'));
  EXPECT_FALSE(IsLetter(0x0301));  // Combining acute (Mn).
  EXPECT_FALSE(IsLetter(kInvalidCodePoint));
  EXPECT_TRUE(IsNumber('7'));
  EXPECT_TRUE(IsNumber(0x0663));  // Arabic-Indic three (Nd).
  EXPECT_TRUE(IsNumber(0x216B));  // Roman numeral twelve (Nl).
  EXPECT_TRUE(IsNumber(0x00BD));  // One half (No).
  EXPECT_FALSE(IsNumber('x'));
  EXPECT_TRUE(IsWhiteSpace(' '));
  EXPECT_TRUE(IsWhiteSpace('\n'));
  EXPECT_TRUE(IsWhiteSpace(0x0B));     // Vertical tab.
  EXPECT_TRUE(IsWhiteSpace(0x85));     // Next line.
  EXPECT_TRUE(IsWhiteSpace(0xA0));     // No-break space.
  EXPECT_TRUE(IsWhiteSpace(0x2028));   // Line separator.
  EXPECT_TRUE(IsWhiteSpace(0x3000));   // Ideographic space.
  EXPECT_FALSE(IsWhiteSpace(0xFEFF));  // BOM: not White_Space.
  EXPECT_FALSE(IsWhiteSpace(0x200B));  // Zero width space: not White_Space.
  EXPECT_FALSE(IsWhiteSpace(kInvalidCodePoint));
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
