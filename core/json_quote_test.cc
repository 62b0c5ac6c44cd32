#include "core/json_quote.h"

#include <cmath>
#include <cstdlib>
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

TEST(JsonFloatTest, ShortestTextThatReadsBack) {
  EXPECT_EQ(JsonFloat(1e-5f), "1e-05");
  EXPECT_EQ(JsonFloat(0.02f), "0.02");
  EXPECT_EQ(JsonFloat(500000.0f), "500000");
  EXPECT_EQ(JsonFloat(-2.5f), "-2.5");
  EXPECT_EQ(JsonFloat(0.0f), "0");
  EXPECT_EQ(JsonFloat(INFINITY), "null");
  EXPECT_EQ(JsonFloat(NAN), "null");
  // Every float reads back exactly.
  for (float v : {0.1f, 1.0f / 3.0f, 3.4028235e38f, 1.17549435e-38f, 1e-45f,
                  0.7978845608f, 12345.678f}) {
    EXPECT_EQ(std::strtof(JsonFloat(v).c_str(), nullptr), v) << JsonFloat(v);
  }
}

}  // namespace
}  // namespace fsdpp
