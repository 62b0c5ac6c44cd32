// ByteTokenizer: one id per byte.
#include "trainer/data/byte_tokenizer.h"

#include "absl/strings/str_cat.h"

namespace fsdpp {
namespace trainer {

std::vector<int32_t> ByteTokenizer::Encode(absl::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (char c : text) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

absl::StatusOr<std::string> ByteTokenizer::Decode(
    absl::Span<const int32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id >= 0 && id < 256) {
      text.push_back(static_cast<char>(id));
    } else if (with_eot_ && id == kEotId) {
      text += "<|endoftext|>";
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("byte tokenizer: id ", id, " at position ", i,
                       " is outside [0, ", vocab_size(), ")"));
    }
  }
  return text;
}

}  // namespace trainer
}  // namespace fsdpp
