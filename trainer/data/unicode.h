// The few Unicode facts the GPT-2 pre-tokenizer needs: UTF-8 decoding and
// membership in \p{L} (letters), \p{N} (numbers) and \s (White_Space).
//
// Design: the classes are sorted range tables generated once from Unicode
// data (unicode_tables.inc, by gen_unicode_tables.js) rather than taken from a
// regex or ICU library, so the tokenizer has no dependency beyond Abseil and
// its behaviour is pinned to the recorded Unicode version. ASCII is answered
// without a table lookup.
#ifndef FSDPP_TRAINER_DATA_UNICODE_H_
#define FSDPP_TRAINER_DATA_UNICODE_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace fsdpp {
namespace trainer {

// What DecodeUtf8 reports for a byte that does not start a well-formed UTF-8
// sequence (it then consumes exactly that one byte).
constexpr int32_t kInvalidCodePoint = -1;

// Decodes the code point starting at text[pos] (pos < text.size()) into
// *code_point and returns its length in bytes (1 to 4). Overlong forms,
// surrogates, values above U+10FFFF and truncated sequences give
// kInvalidCodePoint and length 1.
int DecodeUtf8(absl::string_view text, size_t pos, int32_t* code_point);

// General_Category L (Lu, Ll, Lt, Lm, Lo). False for kInvalidCodePoint.
bool IsLetter(int32_t code_point);

// General_Category N (Nd, Nl, No). False for kInvalidCodePoint.
bool IsNumber(int32_t code_point);

// The White_Space property (U+0009..U+000D, U+0020, U+0085, U+00A0, ...;
// not U+FEFF). False for kInvalidCodePoint.
bool IsWhiteSpace(int32_t code_point);

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_UNICODE_H_
