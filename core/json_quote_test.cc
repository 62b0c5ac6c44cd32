#include "core/json_quote.h"

#include <string>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(JsonQuoteTest, EscapesExactlyWhatJsonNeeds) {
  EXPECT_EQ(JsonQuote(""), "\"\"");
  EXPECT_EQ(JsonQuote(std::string("a\"b\\c\n\x01\x1f\x7f\0/\xc3\xa9", 13)),
            "\"a\\\"b\\\\c\\n\\u0001\\u001F\x7f\\u0000/\xc3\xa9\"");
  EXPECT_EQ(JsonQuote("\b\f\r\t"), "\"\\b\\f\\r\\t\"");
}

}  // namespace
}  // namespace fsdpp
