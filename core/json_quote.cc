#include "core/json_quote.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/str_format.h"

namespace fsdpp {

std::string JsonQuote(absl::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04X", c);
        } else {
          out.push_back(ch);
        }
    }
  }
  out.push_back('"');
  return out;
}

std::string JsonFloat(float v) {
  if (!std::isfinite(v)) return "null";
  // Whole numbers as integers (500000, not 5e+05).
  if (v == std::floor(v) && std::fabs(v) < 1e9f) {
    return absl::StrFormat("%.0f", v);
  }
  for (int digits = 1; digits < 9; ++digits) {
    std::string text = absl::StrFormat("%.*g", digits, v);
    if (std::strtof(text.c_str(), nullptr) == v) return text;
  }
  return absl::StrFormat("%.9g", v);
}

}  // namespace fsdpp
