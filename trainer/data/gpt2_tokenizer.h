// GPT-2's byte-level BPE tokenizer (also tiktoken's "gpt2" encoding), loaded
// from OpenAI's encoder.json + vocab.bpe.
//
// Encoding is two steps, exactly as tiktoken does them:
//   1. Pre-tokenize with GPT-2's pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+
//        |\s+(?!\S)|\s+
//      implemented by hand (Gpt2PreTokenize) over Unicode tables: leftmost
//      alternative first, greedy runs, and for whitespace the lookahead rule
//      that leaves the last space of a run to start the next word.
//   2. Each piece that is itself a token is that token; otherwise its bytes
//      are merged by rank: repeatedly join the adjacent pair whose
//      concatenation has the lowest id (leftmost on ties) until no pair is a
//      token.
// Ranks are looked up by the bytes of the concatenation (tiktoken's rule)
// rather than by the (left, right) pair; the two agree because the loader
// checks that merge i of vocab.bpe makes exactly the token with id 256 + i,
// the property tiktoken's own loader asserts.
//
// Not handled: special tokens in the text ("<|endoftext|>" is encoded as
// ordinary text, like tiktoken's encode_ordinary). Bytes that are not valid
// UTF-8 (which tiktoken cannot receive) pre-tokenize as one-byte symbols
// that are neither letters, numbers nor whitespace.
#ifndef FSDPP_TRAINER_DATA_GPT2_TOKENIZER_H_
#define FSDPP_TRAINER_DATA_GPT2_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "trainer/data/tokenizer.h"

namespace fsdpp {
namespace trainer {

// Where tools/setup.sh puts encoder.json and vocab.bpe (derived from the npm
// tiktoken package's gpt2 ranks; see trainer/data/README.md).
inline constexpr char kDefaultGpt2Directory[] = "/usr/local/share/fsdpp/gpt2";

// The pieces GPT-2's pre-tokenizer pattern splits `text` into, as views into
// `text`, in order; their concatenation is `text`.
std::vector<absl::string_view> Gpt2PreTokenize(absl::string_view text);

// Byte-level BPE with GPT-2's files.
class Gpt2Tokenizer : public Tokenizer {
 public:
  // Loads `directory`/encoder.json and `directory`/vocab.bpe. NotFound (with
  // a hint to run tools/setup.sh) when either file is missing.
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> LoadFromDirectory(
      const std::string& directory);

  // Builds a tokenizer from the two files' contents; `encoder_name` and
  // `merges_name` label errors. The files must be consistent: encoder.json
  // maps GPT-2's printable byte spelling to ids 0..n-1 (each id once) with
  // every single byte present and "<|endoftext|>" as the EOT id when given;
  // vocab.bpe is "#version..." and then one "left right" merge per line,
  // merge i making the token with id 256 + i from two lower-id tokens. Errors
  // are InvalidArgument naming the file, line or token.
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> FromContents(
      absl::string_view encoder_json, absl::string_view vocab_bpe,
      absl::string_view encoder_name = "encoder.json",
      absl::string_view merges_name = "vocab.bpe");

  // "gpt2".
  std::string name() const override { return "gpt2"; }
  // Ordinary tokens plus "<|endoftext|>" (50257 for GPT-2).
  int32_t vocab_size() const override {
    return static_cast<int32_t>(token_bytes_.size());
  }
  // The id of "<|endoftext|>" (50256 for GPT-2), or -1 if the file lacks it.
  int32_t eot_id() const override { return eot_id_; }
  // Pre-tokenizes and merges; equal to tiktoken's encode_ordinary.
  std::vector<int32_t> Encode(absl::string_view text) const override;
  // The tokens' bytes; EOT as "<|endoftext|>".
  absl::StatusOr<std::string> Decode(
      absl::Span<const int32_t> ids) const override;

  // The id of the token whose bytes are `bytes`, or -1.
  int32_t TokenId(absl::string_view bytes) const;

 private:
  Gpt2Tokenizer() = default;

  // Appends the ids of one pre-tokenized piece.
  void EncodePiece(absl::string_view piece, std::vector<int32_t>* ids) const;

  absl::flat_hash_map<std::string, int32_t> ranks_;  // bytes -> id (no EOT)
  std::vector<std::string> token_bytes_;             // id -> bytes
  int32_t eot_id_ = -1;
};

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_GPT2_TOKENIZER_H_
