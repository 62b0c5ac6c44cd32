// Tests for the strict JSON parser and JsonQuote: values, escapes and
// surrogates, exact error messages with byte positions, the depth limit, and
// a deterministic fuzz loop (mutated documents and random bytes) that must
// never crash.
#include "formats/json.h"

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

Json MustParse(absl::string_view text) {
  absl::StatusOr<Json> json = ParseJson(text);
  EXPECT_TRUE(json.ok()) << text << ": " << json.status();
  return json.ok() ? *std::move(json) : Json();
}

TEST(JsonTest, ParsesLiteralsAndNumbers) {
  EXPECT_TRUE(MustParse("null").is_null());
  EXPECT_TRUE(MustParse(" true ").bool_value());
  EXPECT_FALSE(MustParse("\n\tfalse\r").bool_value());

  Json zero = MustParse("0");
  EXPECT_TRUE(zero.is_uint64());
  EXPECT_TRUE(zero.is_int64());
  EXPECT_EQ(zero.uint64_value(), 0u);

  Json big = MustParse("18446744073709551615");
  EXPECT_TRUE(big.is_uint64());
  EXPECT_FALSE(big.is_int64());
  EXPECT_EQ(big.uint64_value(), std::numeric_limits<uint64_t>::max());

  Json too_big = MustParse("18446744073709551616");
  EXPECT_TRUE(too_big.is_number());
  EXPECT_FALSE(too_big.is_uint64());
  EXPECT_FALSE(too_big.is_int64());
  EXPECT_DOUBLE_EQ(too_big.number_value(), 18446744073709551616.0);

  Json min = MustParse("-9223372036854775808");
  EXPECT_TRUE(min.is_int64());
  EXPECT_FALSE(min.is_uint64());
  EXPECT_EQ(min.int64_value(), std::numeric_limits<int64_t>::min());
  EXPECT_FALSE(MustParse("-9223372036854775809").is_int64());
  EXPECT_EQ(MustParse("9223372036854775807").int64_value(),
            std::numeric_limits<int64_t>::max());
  EXPECT_EQ(MustParse("-12").int64_value(), -12);
  EXPECT_TRUE(MustParse("-0").is_uint64());

  Json half = MustParse("1.5");
  EXPECT_FALSE(half.is_uint64());
  EXPECT_FALSE(half.is_int64());
  EXPECT_EQ(half.number_value(), 1.5);
  EXPECT_EQ(MustParse("-2.5e3").number_value(), -2500.0);
  EXPECT_EQ(MustParse("1E+2").number_value(), 100.0);
  EXPECT_FALSE(MustParse("1e2").is_uint64());  // Exponent: not an integer.
  EXPECT_EQ(MustParse("1e-400").number_value(), 0.0);  // Underflow is fine.
}

TEST(JsonTest, ParsesStringsWithEscapesAndUtf8) {
  EXPECT_EQ(MustParse(R"("a\"b\\c\/d\be\ff\ng\rh\ti")").string_value(),
            "a\"b\\c/d\be\ff\ng\rh\ti");
  EXPECT_EQ(MustParse(R"("\u00e9\u00E9")").string_value(), "\xc3\xa9\xc3\xa9");
  EXPECT_EQ(MustParse(R"("\u20ac")").string_value(), "\xe2\x82\xac");
  EXPECT_EQ(MustParse(R"("\ud83d\ude00")").string_value(), "\xf0\x9f\x98\x80");
  EXPECT_EQ(MustParse(R"("\uDBFF\uDFFF")").string_value(), "\xf4\x8f\xbf\xbf");
  EXPECT_EQ(MustParse(R"("\u0000x")").string_value(), std::string("\0x", 2));
  EXPECT_EQ(MustParse("\"raw \xc3\xa9 \xf0\x9f\x98\x80\"").string_value(),
            "raw \xc3\xa9 \xf0\x9f\x98\x80");
  EXPECT_EQ(MustParse("\"\x7f\"").string_value(), "\x7f");
  EXPECT_EQ(MustParse(R"("")").string_value(), "");
}

TEST(JsonTest, ParsesContainersKeepingOrderAndDuplicates) {
  Json json = MustParse(R"( {"b": [1, [], {}], "a": "x", "b": null} )");
  ASSERT_TRUE(json.is_object());
  const Json::Object& members = json.object_value();
  ASSERT_EQ(members.size(), 3u);
  EXPECT_EQ(members[0].first, "b");
  EXPECT_EQ(members[1].first, "a");
  EXPECT_EQ(members[2].first, "b");
  const Json* b = json.Find("b");
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(b->is_array());
  ASSERT_EQ(b->array_value().size(), 3u);
  EXPECT_EQ(b->array_value()[0].uint64_value(), 1u);
  EXPECT_TRUE(b->array_value()[1].array_value().empty());
  EXPECT_TRUE(b->array_value()[2].object_value().empty());
  EXPECT_EQ(json.Find("missing"), nullptr);
  EXPECT_EQ(b->Find("b"), nullptr);  // Not an object.
  EXPECT_TRUE(MustParse("[]").array_value().empty());
  EXPECT_EQ(Json::TypeName(Json::Type::kObject), std::string("object"));
}

struct BadJson {
  std::string text;
  std::string message;
};

TEST(JsonTest, RejectsMalformedInputWithPositions) {
  const std::vector<BadJson> cases = {
      {"", "at byte 0: unexpected end of input"},
      {"   ", "at byte 3: unexpected end of input"},
      {"{", "at byte 1: unexpected end of input"},
      {"[1,", "at byte 3: unexpected end of input"},
      {"{\"a\" 1}",
       "at byte 5: unexpected '1', expected ':' after an object key"},
      {"{\"a\":1,}", "at byte 7: unexpected '}', expected a string key"},
      {"{1:2}", "at byte 1: unexpected '1', expected a string key"},
      {"{\"a\":1 \"b\":2}",
       "at byte 7: unexpected '\"', expected ',' or '}' in an object"},
      {"[1,]", "at byte 3: unexpected ']', expected a JSON value"},
      {"[1 2]", "at byte 3: unexpected '2', expected ',' or ']' in an array"},
      {"01", "at byte 1: unexpected '1' after the JSON value"},
      {"{} x", "at byte 3: unexpected 'x' after the JSON value"},
      {"1 2", "at byte 2: unexpected '2' after the JSON value"},
      {"1.", "at byte 2: expected a digit after '.'"},
      {".5", "at byte 0: unexpected '.', expected a JSON value"},
      {"1e", "at byte 2: expected a digit in an exponent"},
      {"1e+", "at byte 3: expected a digit in an exponent"},
      {"-", "at byte 1: expected a digit in a number"},
      {"-x", "at byte 1: expected a digit in a number"},
      {"+1", "at byte 0: unexpected '+', expected a JSON value"},
      {"1e999", "at byte 0: number 1e999 is out of range"},
      {"[-1e400]", "at byte 1: number -1e400 is out of range"},
      {"tru", "at byte 0: invalid literal, expected 'true'"},
      {"nul", "at byte 0: invalid literal, expected 'null'"},
      {"falsey", "at byte 5: unexpected 'y' after the JSON value"},
      {"NaN", "at byte 0: unexpected 'N', expected a JSON value"},
      {"\x01", "at byte 0: unexpected byte 0x01, expected a JSON value"},
      {"\xef\xbb\xbf{}",
       "at byte 0: unexpected byte 0xEF, expected a JSON value"},
      {"\"abc", "at byte 0: unterminated string"},
      {"[\"a\\", "at byte 3: unterminated escape sequence"},
      {"\"a\nb\"", "at byte 2: unescaped control character 0x0A in a string"},
      {"\"\\x\"", "at byte 1: invalid escape sequence: backslash, then 'x'"},
      {"\"\\\x01\"",
       "at byte 1: invalid escape sequence: backslash, then byte 0x01"},
      {"\"\\u12\"", "at byte 1: \\u must be followed by 4 hex digits"},
      {"\"\\u12g4\"", "at byte 1: \\u must be followed by 4 hex digits"},
      {"\"\\ud800\"", "at byte 1: unpaired high surrogate \\uD800"},
      {"\"\\ud800\\u0041\"", "at byte 1: unpaired high surrogate \\uD800"},
      {"\"\\ud800\\ud800\"", "at byte 1: unpaired high surrogate \\uD800"},
      {"\"\\udc00\"", "at byte 1: unpaired low surrogate \\uDC00"},
      {"\"\xff\"", "at byte 1: invalid UTF-8 in a string"},
      {"\"\xc0\x80\"", "at byte 1: invalid UTF-8 in a string"},  // Overlong.
      {"\"\xe0\x80\xaf\"",
       "at byte 1: invalid UTF-8 in a string"},  // Overlong.
      {"\"\xed\xa0\x80\"",
       "at byte 1: invalid UTF-8 in a string"},  // Surrogate.
      {"\"\xf4\x90\x80\x80\"", "at byte 1: invalid UTF-8 in a string"},
      {"\"\xe2\x82\"", "at byte 1: invalid UTF-8 in a string"},  // Truncated.
      {"\"ok\x80\"", "at byte 3: invalid UTF-8 in a string"},
  };
  for (const BadJson& c : cases) {
    absl::StatusOr<Json> json = ParseJson(c.text);
    ASSERT_FALSE(json.ok()) << c.text;
    EXPECT_EQ(json.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(json.status().message(), c.message) << c.text;
  }
}

JsonLimits Limits(int max_depth, int64_t max_values) {
  JsonLimits limits;
  limits.max_depth = max_depth;
  limits.max_values = max_values;
  return limits;
}

TEST(JsonTest, LimitsNestingDepth) {
  const int depth = JsonLimits().max_depth;
  const std::string ok = std::string(depth, '[') + std::string(depth, ']');
  EXPECT_TRUE(ParseJson(ok).ok());
  const std::string deep = "[" + ok + "]";
  EXPECT_EQ(ParseJson(deep).status().message(),
            "at byte 64: nesting deeper than 64 levels");
  EXPECT_EQ(ParseJson("{\"a\":[1]}", Limits(1, 100)).status().message(),
            "at byte 5: nesting deeper than 1 levels");
  EXPECT_TRUE(ParseJson("{\"a\":1}", Limits(1, 100)).ok());
  EXPECT_TRUE(ParseJson("7", Limits(0, 100)).ok());
  // A million open brackets: an error, not a stack overflow.
  EXPECT_FALSE(ParseJson(std::string(1000000, '[')).ok());
  EXPECT_FALSE(ParseJson(std::string(1000000, '{')).ok());
}

TEST(JsonTest, LimitsTheNumberOfValuesAndKeys) {
  EXPECT_TRUE(ParseJson("[1,2]", Limits(64, 3)).ok());
  EXPECT_EQ(ParseJson("[1,2,3]", Limits(64, 3)).status().message(),
            "at byte 5: more than 3 values and keys");
  // Object keys count too: object, key, value.
  EXPECT_TRUE(ParseJson("{\"a\":1}", Limits(64, 3)).ok());
  EXPECT_EQ(ParseJson("{\"a\":1}", Limits(64, 2)).status().message(),
            "at byte 5: more than 2 values and keys");
  // The default stops a flood of tiny values long before it eats memory.
  std::string flood = "[";
  for (int i = 0; i < (1 << 22) + 1; ++i) flood += "0,";
  flood.back() = ']';
  EXPECT_EQ(ParseJson(flood).status().message(),
            absl::StrCat("at byte ", 2 * ((1 << 22) - 1) + 1,
                         ": more than 4194304 values and keys"));
}

TEST(JsonTest, QuotedStringsParseBack) {
  // JsonQuote (core/json_quote.h): every ASCII byte and some UTF-8 survive a
  // quote + parse round trip.
  std::string all;
  for (int c = 0; c < 128; ++c) all.push_back(static_cast<char>(c));
  all += "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
  EXPECT_EQ(MustParse(JsonQuote(all)).string_value(), all);
}

TEST(JsonTest, ValidatesUtf8) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain"));
  EXPECT_TRUE(IsValidUtf8("\xc2\x80\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf"));
  EXPECT_TRUE(IsValidUtf8("\xf0\x90\x80\x80\xf4\x8f\xbf\xbf"));
  EXPECT_TRUE(IsValidUtf8(std::string("\0", 1)));
  EXPECT_FALSE(IsValidUtf8("\x80"));
  EXPECT_FALSE(IsValidUtf8("\xc1\xbf"));          // Overlong.
  EXPECT_FALSE(IsValidUtf8("\xed\xbf\xbf"));      // Surrogate.
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // > U+10FFFF.
  EXPECT_FALSE(IsValidUtf8("\xf5\x80\x80\x80"));
  EXPECT_FALSE(IsValidUtf8("\xf0\x9f\x98"));  // Truncated.
}

// Deterministic fuzzing: mutations of valid documents and random bytes. Each
// input must parse or fail cleanly; parsed strings are valid UTF-8.
void CheckStringsAreUtf8(const Json& json) {
  switch (json.type()) {
    case Json::Type::kString:
      ASSERT_TRUE(IsValidUtf8(json.string_value()));
      break;
    case Json::Type::kArray:
      for (const Json& v : json.array_value()) CheckStringsAreUtf8(v);
      break;
    case Json::Type::kObject:
      for (const auto& [k, v] : json.object_value()) {
        ASSERT_TRUE(IsValidUtf8(k));
        CheckStringsAreUtf8(v);
      }
      break;
    default:
      break;
  }
}

TEST(JsonTest, FuzzedInputsNeverCrash) {
  const std::vector<std::string> seeds = {
      R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})",
      R"({"__metadata__":{"k":"v\u00e9\ud83d\ude00"},"x":[1.5e3,-0,true,null]})",
      R"([[[[{"deep":[{"er":"\n\t\"\\"}]}]]]])",
      "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"",
      "18446744073709551615",
  };
  const std::string alphabet = "{}[]\":,\\u0123456789abcdefABCDEF-+.eEtrunl \n";
  std::mt19937_64 rng(1234);
  int parsed = 0;
  int rejected = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string text;
    if (i % 10 == 0) {  // Random bytes.
      text.resize(rng() % 64);
      for (char& c : text) c = static_cast<char>(rng());
    } else {
      text = seeds[rng() % seeds.size()];
      const int edits = 1 + static_cast<int>(rng() % 3);
      for (int e = 0; e < edits && !text.empty(); ++e) {
        const size_t at = rng() % text.size();
        switch (rng() % 4) {
          case 0:
            text[at] = static_cast<char>(rng());
            break;
          case 1:
            text[at] = alphabet[rng() % alphabet.size()];
            break;
          case 2:
            text.erase(at, 1 + rng() % 4);
            break;
          case 3:
            text.insert(at, 1, alphabet[rng() % alphabet.size()]);
            break;
        }
      }
    }
    absl::StatusOr<Json> json = ParseJson(text);
    if (json.ok()) {
      ++parsed;
      CheckStringsAreUtf8(*json);
    } else {
      ++rejected;
      ASSERT_EQ(json.status().code(), absl::StatusCode::kInvalidArgument);
      ASSERT_EQ(json.status().message().substr(0, 8), "at byte ");
    }
  }
  EXPECT_GT(parsed, 100);
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace fsdpp
