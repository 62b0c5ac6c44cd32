// Tokenizers by config name ("byte", "gpt2"), for the trainer and its config
// validation.
#ifndef FSDPP_TRAINER_DATA_TOKENIZERS_H_
#define FSDPP_TRAINER_DATA_TOKENIZERS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trainer/data/tokenizer.h"

namespace fsdpp {
namespace trainer {

// The names MakeTokenizer accepts: {"byte", "gpt2"}.
std::vector<std::string> TokenizerNames();

// The number of ids tokenizer `name` produces (byte: 257 with its EOT,
// gpt2: 50257), known without loading any file. InvalidArgument for an
// unknown name.
absl::StatusOr<int32_t> TokenizerVocabSize(const std::string& name);

// The end-of-text id of tokenizer `name` (byte: 256, gpt2: 50256), known
// without loading any file. InvalidArgument for an unknown name.
absl::StatusOr<int32_t> TokenizerEotId(const std::string& name);

// A tokenizer by name: "byte" (ByteTokenizer with EOT) or "gpt2"
// (Gpt2Tokenizer from `gpt2_directory`, or kDefaultGpt2Directory when it is
// empty). InvalidArgument for an unknown name; the GPT-2 loader's errors
// otherwise.
absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(
    const std::string& name, const std::string& gpt2_directory = "");

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_TOKENIZERS_H_
