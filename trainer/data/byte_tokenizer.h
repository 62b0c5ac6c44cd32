// A byte-level tokenizer: id = byte value (256 ids), plus an optional
// end-of-text id 256.
//
// The simplest tokenizer that handles any input, for debug models (vocab 512
// and up) and character-level runs such as the embedded corpus demo.
#ifndef FSDPP_TRAINER_DATA_BYTE_TOKENIZER_H_
#define FSDPP_TRAINER_DATA_BYTE_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "trainer/data/tokenizer.h"

namespace fsdpp {
namespace trainer {

// Bytes as ids 0..255; with_eot adds id 256 ("<|endoftext|>").
class ByteTokenizer : public Tokenizer {
 public:
  // The EOT id when with_eot is set.
  static constexpr int32_t kEotId = 256;

  // 257 ids with the EOT, 256 without.
  explicit ByteTokenizer(bool with_eot = true) : with_eot_(with_eot) {}

  // "byte".
  std::string name() const override { return "byte"; }
  // 257 with EOT, 256 without.
  int32_t vocab_size() const override { return with_eot_ ? 257 : 256; }
  // 256 with EOT, -1 without.
  int32_t eot_id() const override { return with_eot_ ? kEotId : -1; }
  // One id per byte.
  std::vector<int32_t> Encode(absl::string_view text) const override;
  // Bytes back; EOT as "<|endoftext|>".
  absl::StatusOr<std::string> Decode(
      absl::Span<const int32_t> ids) const override;

 private:
  bool with_eot_;
};

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_BYTE_TOKENIZER_H_
