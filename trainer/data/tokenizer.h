// The tokenizer interface the data pipeline and the trainer use: text to
// token ids and back.
//
// Design: Encode never fails (every byte string has an encoding: both
// tokenizers fall back to single bytes), so it returns ids directly; Decode
// fails only for ids outside the vocabulary. Special tokens are never parsed
// out of text: "<|endoftext|>" in the input is encoded as ordinary text (what
// tiktoken calls encode_ordinary), and callers insert eot_id() themselves.
#ifndef FSDPP_TRAINER_DATA_TOKENIZER_H_
#define FSDPP_TRAINER_DATA_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace fsdpp {
namespace trainer {

// Maps text to token ids in [0, vocab_size()) and back.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // The name used in configs ("byte", "gpt2").
  virtual std::string name() const = 0;

  // Number of distinct ids, special tokens included.
  virtual int32_t vocab_size() const = 0;

  // The end-of-text (document separator) id, or -1 when there is none.
  virtual int32_t eot_id() const = 0;

  // The ids of `text` (any bytes; special tokens are not recognised).
  virtual std::vector<int32_t> Encode(absl::string_view text) const = 0;

  // The bytes of `ids` concatenated; the EOT id decodes to its marker text
  // ("<|endoftext|>"). InvalidArgument naming the first id outside
  // [0, vocab_size()).
  virtual absl::StatusOr<std::string> Decode(
      absl::Span<const int32_t> ids) const = 0;
};

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_TOKENIZER_H_
