// Tokenizer factory over ByteTokenizer and Gpt2Tokenizer.
#include "trainer/data/tokenizers.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "trainer/data/byte_tokenizer.h"
#include "trainer/data/gpt2_tokenizer.h"

namespace fsdpp {
namespace trainer {
namespace {

absl::Status UnknownTokenizer(const std::string& name) {
  return absl::InvalidArgumentError(
      absl::StrCat("unknown tokenizer \"", name,
                   "\" (known: ", absl::StrJoin(TokenizerNames(), ", "), ")"));
}

}  // namespace

std::vector<std::string> TokenizerNames() { return {"byte", "gpt2"}; }

absl::StatusOr<int32_t> TokenizerVocabSize(const std::string& name) {
  if (name == "byte") return ByteTokenizer(/*with_eot=*/true).vocab_size();
  if (name == "gpt2") return 50257;
  return UnknownTokenizer(name);
}

absl::StatusOr<int32_t> TokenizerEotId(const std::string& name) {
  if (name == "byte") return ByteTokenizer(/*with_eot=*/true).eot_id();
  if (name == "gpt2") return 50256;  // <|endoftext|>, encoder.json's last
  return UnknownTokenizer(name);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(
    const std::string& name, const std::string& gpt2_directory) {
  if (name == "byte") {
    return std::unique_ptr<Tokenizer>(new ByteTokenizer(/*with_eot=*/true));
  }
  if (name == "gpt2") {
    absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> gpt2 =
        Gpt2Tokenizer::LoadFromDirectory(
            gpt2_directory.empty() ? kDefaultGpt2Directory : gpt2_directory);
    if (!gpt2.ok()) return gpt2.status();
    return std::unique_ptr<Tokenizer>(*std::move(gpt2));
  }
  return UnknownTokenizer(name);
}

}  // namespace trainer
}  // namespace fsdpp
