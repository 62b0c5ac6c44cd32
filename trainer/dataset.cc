// LoadDataset: tokenizer + source + split.
#include "trainer/dataset.h"

#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "trainer/data/corpus.h"
#include "trainer/data/sft.h"
#include "trainer/data/token_file.h"
#include "trainer/data/tokenizers.h"

namespace fsdpp {
namespace trainer {
namespace {

std::vector<int32_t> EncodeDocument(const Tokenizer& tokenizer,
                                    absl::string_view text) {
  std::vector<int32_t> tokens;
  if (tokenizer.eot_id() >= 0) tokens.push_back(tokenizer.eot_id());
  std::vector<int32_t> body = tokenizer.Encode(text);
  tokens.insert(tokens.end(), body.begin(), body.end());
  return tokens;
}

}  // namespace

absl::StatusOr<Dataset> LoadDataset(const DataConfig& config) {
  const double fraction = config.validation_fraction();
  if (!(fraction >= 0.0 && fraction < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.validation_fraction must be in [0, 1), got ", fraction));
  }
  Dataset dataset;
  FSDPP_ASSIGN_OR_RETURN(
      dataset.tokenizer,
      MakeTokenizer(config.tokenizer(), config.tokenizer_dir()));
  const Tokenizer& tokenizer = *dataset.tokenizer;
  std::string source;
  if (config.dataset() == "embedded") {
    dataset.tokens =
        TokenStore::FromVector(EncodeDocument(tokenizer, EmbeddedCorpus()));
    source =
        absl::StrCat("embedded corpus (", EmbeddedCorpusDescription(), ")");
  } else if (config.dataset() == "embedded_chat" ||
             absl::EndsWith(config.dataset(), ".jsonl")) {
    std::vector<SftExample> examples;
    if (config.dataset() == "embedded_chat") {
      examples = EmbeddedChatExamples();
      source = EmbeddedChatDescription();
    } else {
      FSDPP_ASSIGN_OR_RETURN(std::string text,
                             ReadFileToString(config.dataset(), "SFT dataset"));
      FSDPP_ASSIGN_OR_RETURN(examples, ParseSftJsonl(text, config.dataset()));
      source = absl::StrCat("SFT file \"", config.dataset(), "\"");
    }
    FSDPP_ASSIGN_OR_RETURN(SftTokens packed, PackSft(tokenizer, examples));
    absl::StrAppend(&source, ", ", packed.examples, " examples, ",
                    absl::StrFormat("%.1f%%", 100.0 * packed.trained /
                                                  packed.tokens.size()),
                    " of the tokens trained on");
    dataset.tokens = TokenStore::FromVector(std::move(packed.tokens),
                                            std::move(packed.loss_mask));
  } else if (absl::EndsWith(config.dataset(), ".bin")) {
    FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<TokenFile> file,
                           TokenFile::Open(config.dataset()));
    dataset.tokens = TokenStore::FromFile(std::move(file));
    if (dataset.tokens->max_token() >= tokenizer.vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data.dataset \"", config.dataset(), "\" holds token ",
          dataset.tokens->max_token(), ", outside the ", tokenizer.name(),
          " tokenizer's ", tokenizer.vocab_size(), " ids"));
    }
    source = absl::StrCat("token file \"", config.dataset(), "\"");
  } else {
    FSDPP_ASSIGN_OR_RETURN(std::string text,
                           ReadFileToString(config.dataset(), "text dataset"));
    dataset.tokens = TokenStore::FromVector(EncodeDocument(tokenizer, text));
    source = absl::StrCat("text file \"", config.dataset(), "\"");
  }
  const int64_t total = dataset.tokens->size();
  const int64_t validation =
      static_cast<int64_t>(std::floor(static_cast<double>(total) * fraction));
  dataset.train = {0, total - validation};
  dataset.validation = {total - validation, total};
  dataset.description = absl::StrCat(
      source, ": ", total, " ", tokenizer.name(), " tokens (train ",
      dataset.train.size(), ", validation ", dataset.validation.size(), ")");
  return dataset;
}

absl::StatusOr<std::unique_ptr<DataLoader>> MakeLoader(
    const Dataset& dataset, const TokenRange& range,
    const LoaderOptions& options) {
  return DataLoader::Create(dataset.tokens, range.begin, range.end, options);
}

}  // namespace trainer
}  // namespace fsdpp
