// UTF-8 decoding and Unicode class lookups over the generated range tables.
#include "trainer/data/unicode.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

namespace fsdpp {
namespace trainer {
namespace {

// An inclusive range of code points.
struct CodePointRange {
  int32_t first;
  int32_t last;
};

#include "trainer/data/unicode_tables.inc"

template <size_t N>
bool InRanges(const CodePointRange (&ranges)[N], int32_t code_point) {
  const CodePointRange* end = ranges + N;
  // The first range whose last code point is >= code_point.
  const CodePointRange* it = std::lower_bound(
      ranges, end, code_point,
      [](const CodePointRange& range, int32_t cp) { return range.last < cp; });
  return it != end && it->first <= code_point;
}

}  // namespace

int DecodeUtf8(absl::string_view text, size_t pos, int32_t* code_point) {
  const auto byte = [&](size_t i) {
    return static_cast<uint8_t>(text[pos + i]);
  };
  const uint8_t lead = byte(0);
  if (lead < 0x80) {
    *code_point = lead;
    return 1;
  }
  int length;
  int32_t value;
  int32_t min_value;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
    value = lead & 0x1F;
    min_value = 0x80;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    value = lead & 0x0F;
    min_value = 0x800;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    value = lead & 0x07;
    min_value = 0x10000;
  } else {
    *code_point = kInvalidCodePoint;
    return 1;
  }
  if (text.size() - pos < static_cast<size_t>(length)) {
    *code_point = kInvalidCodePoint;
    return 1;
  }
  for (int i = 1; i < length; ++i) {
    const uint8_t continuation = byte(i);
    if ((continuation & 0xC0) != 0x80) {
      *code_point = kInvalidCodePoint;
      return 1;
    }
    value = (value << 6) | (continuation & 0x3F);
  }
  if (value < min_value || value > 0x10FFFF ||
      (value >= 0xD800 && value <= 0xDFFF)) {
    *code_point = kInvalidCodePoint;
    return 1;
  }
  *code_point = value;
  return length;
}

bool IsLetter(int32_t code_point) {
  if (code_point < 0x80) {
    return (code_point >= 'a' && code_point <= 'z') ||
           (code_point >= 'A' && code_point <= 'Z');
  }
  return InRanges(kLetterRanges, code_point);
}

bool IsNumber(int32_t code_point) {
  if (code_point < 0x80) return code_point >= '0' && code_point <= '9';
  return InRanges(kNumberRanges, code_point);
}

bool IsWhiteSpace(int32_t code_point) {
  if (code_point < 0x80) {
    return code_point == ' ' || (code_point >= 0x09 && code_point <= 0x0D);
  }
  return InRanges(kWhiteSpaceRanges, code_point);
}

}  // namespace trainer
}  // namespace fsdpp
