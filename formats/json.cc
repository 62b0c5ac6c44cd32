// JSON parser and string escaper; see json.h. The parser is a recursive
// descent over the bytes with an explicit depth bound; every read of the input
// is bounds-checked against its size first, so arbitrary bytes are safe.
#include "formats/json.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <variant>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/logging.h"
#include "core/status.h"

namespace fsdpp {
namespace {

bool IsContinuation(unsigned char c) { return (c & 0xC0) == 0x80; }

// Length of the well-formed UTF-8 sequence starting at p[0] (with `n` bytes
// available), or 0 when it is malformed or truncated (Unicode table 3-7).
size_t Utf8SequenceLength(const unsigned char* p, size_t n) {
  const unsigned char c = p[0];
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    return n >= 2 && IsContinuation(p[1]) ? 2 : 0;
  }
  if (c >= 0xE0 && c <= 0xEF) {
    if (n < 3) return 0;
    const unsigned char lo = c == 0xE0 ? 0xA0 : 0x80;  // No overlong forms.
    const unsigned char hi = c == 0xED ? 0x9F : 0xBF;  // No surrogates.
    return p[1] >= lo && p[1] <= hi && IsContinuation(p[2]) ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (n < 4) return 0;
    const unsigned char lo = c == 0xF0 ? 0x90 : 0x80;  // No overlong forms.
    const unsigned char hi = c == 0xF4 ? 0x8F : 0xBF;  // <= U+10FFFF.
    return p[1] >= lo && p[1] <= hi && IsContinuation(p[2]) &&
                   IsContinuation(p[3])
               ? 4
               : 0;
  }
  return 0;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// "'x'" for printable ASCII, "byte 0xNN" otherwise.
std::string DescribeByte(unsigned char c) {
  if (c >= 0x20 && c < 0x7F) return absl::StrCat("'", std::string(1, c), "'");
  return absl::StrFormat("byte 0x%02X", c);
}

bool IsDigit(unsigned char c) { return c >= '0' && c <= '9'; }

}  // namespace

// Recursive-descent parser over one input; see ParseJson.
class JsonParser {
 public:
  JsonParser(absl::string_view text, const JsonLimits& limits)
      : p_(reinterpret_cast<const unsigned char*>(text.data())),
        n_(text.size()),
        limits_(limits) {}

  absl::StatusOr<Json> Parse() {
    Json value;
    SkipWhitespace();
    FSDPP_RETURN_IF_ERROR(ParseValue(&value, 0));
    SkipWhitespace();
    if (pos_ != n_) {
      return Error(pos_, absl::StrCat("unexpected ", DescribeByte(p_[pos_]),
                                      " after the JSON value"));
    }
    return value;
  }

 private:
  static absl::Status Error(size_t pos, absl::string_view problem) {
    return absl::InvalidArgumentError(
        absl::StrCat("at byte ", pos, ": ", problem));
  }
  absl::Status EndOfInput() const {
    return Error(pos_, "unexpected end of input");
  }

  void SkipWhitespace() {
    while (pos_ < n_ && (p_[pos_] == ' ' || p_[pos_] == '\t' ||
                         p_[pos_] == '\n' || p_[pos_] == '\r')) {
      ++pos_;
    }
  }

  // Counts one more value (or object key) against limits_.max_values.
  absl::Status CountValue() {
    if (++values_ > limits_.max_values) {
      return Error(pos_, absl::StrCat("more than ", limits_.max_values,
                                      " values and keys"));
    }
    return absl::OkStatus();
  }

  absl::Status ParseValue(Json* out, int depth) {
    if (pos_ >= n_) return EndOfInput();
    FSDPP_RETURN_IF_ERROR(CountValue());
    const unsigned char c = p_[pos_];
    switch (c) {
      case '{':
        return ParseObject(out, depth);
      case '[':
        return ParseArray(out, depth);
      case '"':
        return ParseString(&out->value_.emplace<std::string>());
      case 't':
        out->value_ = true;
        return ParseLiteral("true");
      case 'f':
        out->value_ = false;
        return ParseLiteral("false");
      case 'n':
        out->value_ = std::monostate();
        return ParseLiteral("null");
      default:
        if (c == '-' || IsDigit(c)) return ParseNumber(out);
        return Error(pos_, absl::StrCat("unexpected ", DescribeByte(c),
                                        ", expected a JSON value"));
    }
  }

  absl::Status EnterContainer(int depth) const {
    if (depth >= limits_.max_depth) {
      return Error(pos_, absl::StrCat("nesting deeper than ", limits_.max_depth,
                                      " levels"));
    }
    return absl::OkStatus();
  }

  absl::Status ParseObject(Json* out, int depth) {
    FSDPP_RETURN_IF_ERROR(EnterContainer(depth));
    Json::Object& members = out->value_.emplace<Json::Object>();
    ++pos_;  // '{'
    SkipWhitespace();
    if (pos_ < n_ && p_[pos_] == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    for (;;) {
      if (pos_ >= n_) return EndOfInput();
      if (p_[pos_] != '"') {
        return Error(pos_, absl::StrCat("unexpected ", DescribeByte(p_[pos_]),
                                        ", expected a string key"));
      }
      FSDPP_RETURN_IF_ERROR(CountValue());
      std::string key;
      FSDPP_RETURN_IF_ERROR(ParseString(&key));
      SkipWhitespace();
      if (pos_ >= n_) return EndOfInput();
      if (p_[pos_] != ':') {
        return Error(pos_, absl::StrCat("unexpected ", DescribeByte(p_[pos_]),
                                        ", expected ':' after an object key"));
      }
      ++pos_;
      SkipWhitespace();
      members.emplace_back(std::piecewise_construct,
                           std::forward_as_tuple(std::move(key)),
                           std::forward_as_tuple());
      FSDPP_RETURN_IF_ERROR(ParseValue(&members.back().second, depth + 1));
      SkipWhitespace();
      if (pos_ >= n_) return EndOfInput();
      if (p_[pos_] == '}') {
        ++pos_;
        return absl::OkStatus();
      }
      if (p_[pos_] != ',') {
        return Error(pos_, absl::StrCat("unexpected ", DescribeByte(p_[pos_]),
                                        ", expected ',' or '}' in an object"));
      }
      ++pos_;
      SkipWhitespace();
    }
  }

  absl::Status ParseArray(Json* out, int depth) {
    FSDPP_RETURN_IF_ERROR(EnterContainer(depth));
    Json::Array& elements = out->value_.emplace<Json::Array>();
    ++pos_;  // '['
    SkipWhitespace();
    if (pos_ < n_ && p_[pos_] == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    for (;;) {
      elements.emplace_back();
      FSDPP_RETURN_IF_ERROR(ParseValue(&elements.back(), depth + 1));
      SkipWhitespace();
      if (pos_ >= n_) return EndOfInput();
      if (p_[pos_] == ']') {
        ++pos_;
        return absl::OkStatus();
      }
      if (p_[pos_] != ',') {
        return Error(pos_, absl::StrCat("unexpected ", DescribeByte(p_[pos_]),
                                        ", expected ',' or ']' in an array"));
      }
      ++pos_;
      SkipWhitespace();
    }
  }

  absl::Status ParseLiteral(absl::string_view literal) {
    const size_t start = pos_;
    for (char expected : literal) {
      if (pos_ >= n_ || p_[pos_] != static_cast<unsigned char>(expected)) {
        return Error(start,
                     absl::StrCat("invalid literal, expected '", literal, "'"));
      }
      ++pos_;
    }
    return absl::OkStatus();
  }

  // Four hex digits at p_[at..at+4) as a code unit, or -1.
  int32_t Hex4(size_t at) const {
    if (at > n_ || n_ - at < 4) return -1;
    int32_t v = 0;
    for (size_t i = at; i < at + 4; ++i) {
      const unsigned char c = p_[i];
      int32_t digit;
      if (c >= '0' && c <= '9') {
        digit = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        digit = c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        digit = c - 'A' + 10;
      } else {
        return -1;
      }
      v = v * 16 + digit;
    }
    return v;
  }

  // pos_ is at the backslash; appends the decoded character(s).
  absl::Status ParseEscape(std::string* out) {
    const size_t start = pos_;
    if (pos_ + 1 >= n_) return Error(start, "unterminated escape sequence");
    const unsigned char c = p_[pos_ + 1];
    pos_ += 2;
    switch (c) {
      case '"':
        out->push_back('"');
        return absl::OkStatus();
      case '\\':
        out->push_back('\\');
        return absl::OkStatus();
      case '/':
        out->push_back('/');
        return absl::OkStatus();
      case 'b':
        out->push_back('\b');
        return absl::OkStatus();
      case 'f':
        out->push_back('\f');
        return absl::OkStatus();
      case 'n':
        out->push_back('\n');
        return absl::OkStatus();
      case 'r':
        out->push_back('\r');
        return absl::OkStatus();
      case 't':
        out->push_back('\t');
        return absl::OkStatus();
      case 'u':
        break;
      default:
        return Error(start, absl::StrCat("invalid escape sequence: backslash, "
                                         "then ",
                                         DescribeByte(c)));
    }
    const int32_t unit = Hex4(pos_);
    if (unit < 0) return Error(start, "\\u must be followed by 4 hex digits");
    pos_ += 4;
    uint32_t cp = static_cast<uint32_t>(unit);
    if (cp >= 0xDC00 && cp <= 0xDFFF) {
      return Error(start,
                   absl::StrFormat("unpaired low surrogate \\u%04X", cp));
    }
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      const int32_t low =
          pos_ + 1 < n_ && p_[pos_] == '\\' && p_[pos_ + 1] == 'u'
              ? Hex4(pos_ + 2)
              : -1;
      if (low < 0xDC00 || low > 0xDFFF) {
        return Error(start,
                     absl::StrFormat("unpaired high surrogate \\u%04X", cp));
      }
      pos_ += 6;
      cp = 0x10000 + ((cp - 0xD800) << 10) +
           (static_cast<uint32_t>(low) - 0xDC00);
    }
    AppendUtf8(cp, out);
    return absl::OkStatus();
  }

  // pos_ is at the opening quote.
  absl::Status ParseString(std::string* out) {
    const size_t start = pos_;
    ++pos_;
    for (;;) {
      // Copy the run of plain ASCII characters in one go.
      const size_t run = pos_;
      while (pos_ < n_ && p_[pos_] >= 0x20 && p_[pos_] < 0x80 &&
             p_[pos_] != '"' && p_[pos_] != '\\') {
        ++pos_;
      }
      out->append(reinterpret_cast<const char*>(p_ + run), pos_ - run);
      if (pos_ >= n_) return Error(start, "unterminated string");
      const unsigned char c = p_[pos_];
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (c == '\\') {
        FSDPP_RETURN_IF_ERROR(ParseEscape(out));
      } else if (c < 0x20) {
        return Error(pos_,
                     absl::StrFormat(
                         "unescaped control character 0x%02X in a string", c));
      } else {
        const size_t len = Utf8SequenceLength(p_ + pos_, n_ - pos_);
        if (len == 0) return Error(pos_, "invalid UTF-8 in a string");
        out->append(reinterpret_cast<const char*>(p_ + pos_), len);
        pos_ += len;
      }
    }
  }

  absl::Status ParseNumber(Json* out) {
    const size_t start = pos_;
    const bool negative = p_[pos_] == '-';
    if (negative) ++pos_;
    if (pos_ >= n_ || !IsDigit(p_[pos_])) {
      return Error(pos_, "expected a digit in a number");
    }
    // Integer part, accumulated exactly while it fits in 64 bits.
    uint64_t magnitude = 0;
    bool fits = true;
    if (p_[pos_] == '0') {
      ++pos_;
    } else {
      while (pos_ < n_ && IsDigit(p_[pos_])) {
        const uint64_t digit = p_[pos_] - '0';
        if (magnitude > (std::numeric_limits<uint64_t>::max() - digit) / 10) {
          fits = false;
        } else {
          magnitude = magnitude * 10 + digit;
        }
        ++pos_;
      }
    }
    bool integral = true;
    if (pos_ < n_ && p_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (pos_ >= n_ || !IsDigit(p_[pos_])) {
        return Error(pos_, "expected a digit after '.'");
      }
      while (pos_ < n_ && IsDigit(p_[pos_])) ++pos_;
    }
    if (pos_ < n_ && (p_[pos_] == 'e' || p_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < n_ && (p_[pos_] == '+' || p_[pos_] == '-')) ++pos_;
      if (pos_ >= n_ || !IsDigit(p_[pos_])) {
        return Error(pos_, "expected a digit in an exponent");
      }
      while (pos_ < n_ && IsDigit(p_[pos_])) ++pos_;
    }
    Json::Number& number = out->value_.emplace<Json::Number>();
    if (integral && fits) {
      // Exact integer; the double is its correctly rounded conversion.
      constexpr uint64_t kInt64Max = std::numeric_limits<int64_t>::max();
      number.bits = negative ? ~magnitude + 1 : magnitude;  // Two's complement.
      number.is_uint64 = !negative || magnitude == 0;
      number.is_int64 =
          negative ? magnitude <= kInt64Max + 1 : magnitude <= kInt64Max;
      number.value = negative ? -static_cast<double>(magnitude)
                              : static_cast<double>(magnitude);
      return absl::OkStatus();
    }
    const absl::string_view lexeme(reinterpret_cast<const char*>(p_ + start),
                                   pos_ - start);
    if (!absl::SimpleAtod(lexeme, &number.value) ||
        !std::isfinite(number.value)) {
      return Error(start, absl::StrCat("number ", lexeme, " is out of range"));
    }
    return absl::OkStatus();
  }

  const unsigned char* p_;
  size_t n_;
  JsonLimits limits_;
  size_t pos_ = 0;
  int64_t values_ = 0;
};

bool Json::is_uint64() const {
  const Number* n = std::get_if<Number>(&value_);
  return n != nullptr && n->is_uint64;
}

bool Json::is_int64() const {
  const Number* n = std::get_if<Number>(&value_);
  return n != nullptr && n->is_int64;
}

bool Json::bool_value() const {
  CHECK(is_bool()) << "JSON " << TypeName(type()) << " is not a bool";
  return std::get<bool>(value_);
}

double Json::number_value() const {
  CHECK(is_number()) << "JSON " << TypeName(type()) << " is not a number";
  return std::get<Number>(value_).value;
}

uint64_t Json::uint64_value() const {
  CHECK(is_uint64()) << "JSON value is not an unsigned 64-bit integer";
  return std::get<Number>(value_).bits;
}

int64_t Json::int64_value() const {
  CHECK(is_int64()) << "JSON value is not a signed 64-bit integer";
  // Two's complement back to signed, without implementation-defined casts.
  const uint64_t bits = std::get<Number>(value_).bits;
  int64_t v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

const std::string& Json::string_value() const {
  CHECK(is_string()) << "JSON " << TypeName(type()) << " is not a string";
  return std::get<std::string>(value_);
}

const Json::Array& Json::array_value() const {
  CHECK(is_array()) << "JSON " << TypeName(type()) << " is not an array";
  return std::get<Array>(value_);
}

const Json::Object& Json::object_value() const {
  CHECK(is_object()) << "JSON " << TypeName(type()) << " is not an object";
  return std::get<Object>(value_);
}

const Json* Json::Find(absl::string_view key) const {
  if (!is_object()) return nullptr;
  for (const auto& [k, v] : std::get<Object>(value_)) {
    if (k == key) return &v;
  }
  return nullptr;
}

const char* Json::TypeName(Type type) {
  switch (type) {
    case Type::kNull:
      return "null";
    case Type::kBool:
      return "bool";
    case Type::kNumber:
      return "number";
    case Type::kString:
      return "string";
    case Type::kArray:
      return "array";
    case Type::kObject:
      return "object";
  }
  return "unknown";
}

absl::StatusOr<Json> ParseJson(absl::string_view text,
                               const JsonLimits& limits) {
  return JsonParser(text, limits).Parse();
}

bool IsValidUtf8(absl::string_view s) {
  const unsigned char* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    const size_t len = Utf8SequenceLength(p + i, s.size() - i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

}  // namespace fsdpp
