// A small, strict JSON (RFC 8259) parser and string escaper, for file headers
// such as the safetensors one.
//
// Design: the parser is built to face untrusted bytes. It accepts exactly the
// RFC grammar (no comments, trailing commas, NaN, leading '+' or zeros), checks
// that strings are valid UTF-8 (surrogate pairs in \u escapes are combined,
// lone surrogates rejected), limits nesting depth so recursion is bounded, and
// reports errors as InvalidArgument "at byte N: <problem>". Object members
// keep document order and duplicates, so callers decide what a repeated key
// means. Numbers keep their exact integer value when the literal is an integer
// that fits in 64 bits; others are doubles (overflow to infinity is an error).
// Values are compact (a variant) and their count is capped (JsonLimits), so
// a hostile document cannot make the tree take many times its own size.
#ifndef FSDPP_FORMATS_JSON_H_
#define FSDPP_FORMATS_JSON_H_

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/json_quote.h"  // JsonQuote, for writers of JSON.

namespace fsdpp {

// One parsed JSON value (null, bool, number, string, array or object). A
// value takes 40 bytes plus its string/array/object payload.
class Json {
 public:
  // The kind of value.
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  // Members in document order; duplicate keys are kept.
  using Object = std::vector<std::pair<std::string, Json>>;
  // Elements in document order.
  using Array = std::vector<Json>;

  // A null value.
  Json() = default;

  // The kind of value, and one predicate per kind.
  Type type() const { return static_cast<Type>(value_.index()); }
  bool is_null() const { return type() == Type::kNull; }
  bool is_bool() const { return type() == Type::kBool; }
  bool is_number() const { return type() == Type::kNumber; }
  bool is_string() const { return type() == Type::kString; }
  bool is_array() const { return type() == Type::kArray; }
  bool is_object() const { return type() == Type::kObject; }
  // True for an integer literal (no fraction or exponent) in [0, 2^64).
  bool is_uint64() const;
  // True for an integer literal in [-2^63, 2^63).
  bool is_int64() const;

  // Accessors; each CHECK-fails when the value has another type (or, for the
  // integer ones, is not an integer literal in range).
  bool bool_value() const;
  double number_value() const;  // Any number (integers converted, rounded).
  uint64_t uint64_value() const;
  int64_t int64_value() const;
  const std::string& string_value() const;
  const Array& array_value() const;
  const Object& object_value() const;

  // The first member named `key` of an object, or nullptr (also for
  // non-objects).
  const Json* Find(absl::string_view key) const;

  // "null", "bool", "number", "string", "array" or "object".
  static const char* TypeName(Type type);

 private:
  friend class JsonParser;

  struct Number {
    double value = 0;
    uint64_t bits = 0;  // The integer literal's value (two's complement).
    bool is_uint64 = false;
    bool is_int64 = false;
  };
  // Alternatives in Type order.
  std::variant<std::monostate, bool, Number, std::string, Array, Object> value_;
};

// Bounds that keep ParseJson's stack and memory use proportionate on
// untrusted input.
struct JsonLimits {
  // Arrays/objects nested deeper than this are an error (bounds recursion).
  int max_depth = 64;
  // Documents with more values (scalars, arrays, objects) plus object keys
  // than this are an error. The tree takes at most ~80 bytes per counted item
  // (about 320 MiB at the default) plus the string bytes, which are bounded
  // by the input size. A safetensors entry counts ~12, so the default admits
  // ~350k tensors.
  int64_t max_values = int64_t{1} << 22;
};

// Parses `text` (exactly one JSON value, optionally surrounded by whitespace).
// Errors are InvalidArgument "at byte N: <problem>", N counted from the start
// of `text`.
absl::StatusOr<Json> ParseJson(absl::string_view text,
                               const JsonLimits& limits = JsonLimits());

// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or code
// points above U+10FFFF).
bool IsValidUtf8(absl::string_view s);

}  // namespace fsdpp

#endif  // FSDPP_FORMATS_JSON_H_
