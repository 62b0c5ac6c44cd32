// Quoting a string for JSON output (trace files, metrics lines, checkpoint
// inspection). The strict JSON parser is in formats/json.h.
#ifndef FSDPP_CORE_JSON_QUOTE_H_
#define FSDPP_CORE_JSON_QUOTE_H_

#include <string>

#include "absl/strings/string_view.h"

namespace fsdpp {

// `s` as a quoted JSON string: '"' and '\' escaped, control characters as
// \b \f \n \r \t or \u00XX, everything else (including UTF-8) verbatim. The
// result is valid JSON only when `s` is valid UTF-8.
std::string JsonQuote(absl::string_view s);

// A finite float as the shortest decimal (at most 9 significant digits) that
// reads back as the same float: 1e-05, not 9.99999975e-06; whole numbers
// below 1e9 as integers (500000). Non-finite values (not JSON) come out as
// "null".
std::string JsonFloat(float v);

}  // namespace fsdpp

#endif  // FSDPP_CORE_JSON_QUOTE_H_
