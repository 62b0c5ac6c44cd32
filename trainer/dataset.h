// Turns a DataConfig into tokens: picks the tokenizer, reads the dataset
// (the embedded corpus, a text file, a llm.c .bin shard, or chat / SFT
// examples: the embedded chat set or a JSONL file) and splits it into train
// and validation ranges, ready for DataLoader.
//
// SFT examples (trainer/data/sft.h) are packed as documents with a loss
// mask: the store's prompt tokens are not targets (the loader gives them as
// ignored targets, and the step's loss is the token mean over the global
// batch's trained targets).
//
// Text (the embedded corpus or a file) is one document: its tokens are the
// tokenizer's EOT followed by the encoded text, as llm.c's data scripts lay
// out documents. A .bin shard is used as is (mapped, not copied); its ids
// must be below the tokenizer's vocabulary so that they decode. The
// validation split is the last floor(tokens x validation_fraction) tokens.
#ifndef FSDPP_TRAINER_DATASET_H_
#define FSDPP_TRAINER_DATASET_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "trainer/config.pb.h"
#include "trainer/data/loader.h"
#include "trainer/data/token_store.h"
#include "trainer/data/tokenizer.h"

namespace fsdpp {
namespace trainer {

// A half-open token range [begin, end) of a TokenStore.
struct TokenRange {
  int64_t begin = 0;
  int64_t end = 0;
  // Tokens in the range.
  int64_t size() const { return end - begin; }
};

// Tokens of a run with their tokenizer and splits.
struct Dataset {
  std::unique_ptr<Tokenizer> tokenizer;      // The config's tokenizer.
  std::shared_ptr<const TokenStore> tokens;  // All tokens of the dataset.
  TokenRange train;                          // The first tokens.
  TokenRange validation;  // Empty when validation_fraction is 0.
  // For logs: "embedded corpus (...): N byte tokens (train T, validation V)".
  std::string description;
};

// Loads what `config` names. Errors: the tokenizer's (unknown name, missing
// GPT-2 files), NotFound/InvalidArgument from reading the dataset file,
// InvalidArgument for a shard token outside the tokenizer's vocabulary or a
// validation_fraction outside [0, 1).
absl::StatusOr<Dataset> LoadDataset(const DataConfig& config);

// A loader over `range` of `dataset` (train or validation).
absl::StatusOr<std::unique_ptr<DataLoader>> MakeLoader(
    const Dataset& dataset, const TokenRange& range,
    const LoaderOptions& options);

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATASET_H_
