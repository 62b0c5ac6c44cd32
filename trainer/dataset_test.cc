// Tests of LoadDataset: the embedded corpus, text files and .bin shards, the
// validation split, and the errors (exact text).
#include "trainer/dataset.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "formats/file_util.h"
#include "gtest/gtest.h"
#include "trainer/data/corpus.h"
#include "trainer/data/token_file.h"

namespace fsdpp {
namespace trainer {
namespace {

std::string TempPath(absl::string_view name) {
  return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
}

std::vector<int32_t> ReadAll(const Dataset& dataset) {
  std::vector<int32_t> tokens(dataset.tokens->size());
  dataset.tokens->Read(0, dataset.tokens->size(), tokens.data());
  return tokens;
}

TEST(DatasetTest, EmbeddedCorpusWithByteTokens) {
  DataConfig config;  // Defaults: embedded, byte, 5% validation.
  auto dataset = LoadDataset(config);
  ASSERT_TRUE(dataset.ok()) << dataset.status();
  const int64_t total = static_cast<int64_t>(EmbeddedCorpus().size()) + 1;
  ASSERT_EQ(dataset->tokens->size(), total);
  const std::vector<int32_t> tokens = ReadAll(*dataset);
  EXPECT_EQ(tokens[0], 256);  // EOT starts the document.
  EXPECT_EQ(tokens[1], static_cast<uint8_t>(EmbeddedCorpus()[0]));
  const int64_t validation = total * 5 / 100;  // floor(total x 0.05)
  EXPECT_EQ(dataset->train.begin, 0);
  EXPECT_EQ(dataset->train.end, total - validation);
  EXPECT_EQ(dataset->validation.begin, total - validation);
  EXPECT_EQ(dataset->validation.end, total);
  EXPECT_EQ(dataset->description,
            absl::StrCat("embedded corpus (", EmbeddedCorpusDescription(),
                         "): ", total, " byte tokens (train ",
                         total - validation, ", validation ", validation, ")"));

  LoaderOptions options;
  options.seq_len = 64;
  options.batch_size = 2;
  auto train = MakeLoader(*dataset, dataset->train, options);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ((*train)->num_sequences(), (total - validation - 1) / 64);
  auto held_out = MakeLoader(*dataset, dataset->validation, options);
  ASSERT_TRUE(held_out.ok()) << held_out.status();
  EXPECT_EQ((*held_out)->WindowStart(0), total - validation);
}

TEST(DatasetTest, TextFile) {
  const std::string path = TempPath("text.txt");
  ASSERT_TRUE(WriteFileAtomically(path, "hello world").ok());
  DataConfig config;
  config.set_dataset(path);
  config.set_validation_fraction(0.0);
  auto dataset = LoadDataset(config);
  ASSERT_TRUE(dataset.ok()) << dataset.status();
  EXPECT_EQ(ReadAll(*dataset),
            (std::vector<int32_t>{256, 'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o',
                                  'r', 'l', 'd'}));
  EXPECT_EQ(dataset->validation.size(), 0);
  EXPECT_EQ(dataset->description,
            absl::StrCat("text file \"", path,
                         "\": 12 byte tokens (train 12, validation 0)"));
}

TEST(DatasetTest, TokenShard) {
  const std::string path = TempPath("shard.bin");
  std::vector<int32_t> tokens(1000);
  for (int i = 0; i < 1000; ++i) tokens[i] = i % 257;
  ASSERT_TRUE(WriteTokenFile(path, tokens).ok());
  DataConfig config;
  config.set_dataset(path);
  config.set_validation_fraction(0.1);
  auto dataset = LoadDataset(config);
  ASSERT_TRUE(dataset.ok()) << dataset.status();
  EXPECT_EQ(ReadAll(*dataset), tokens);
  EXPECT_EQ(dataset->train.end, 900);
  EXPECT_EQ(dataset->validation.size(), 100);
}

TEST(DatasetTest, Errors) {
  const std::string shard = TempPath("wide.bin");
  ASSERT_TRUE(WriteTokenFile(shard, {1, 2, 300}).ok());
  DataConfig config;
  config.set_dataset(shard);
  EXPECT_EQ(LoadDataset(config).status().message(),
            absl::StrCat("data.dataset \"", shard,
                         "\" holds token 300, outside the byte tokenizer's "
                         "257 ids"));
  config.set_dataset(TempPath("missing.txt"));
  EXPECT_EQ(LoadDataset(config).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadDataset(config).status().message(),
            absl::StrCat("cannot read text dataset \"", TempPath("missing.txt"),
                         "\": No such file or directory"));
  config.set_dataset("embedded");
  config.set_tokenizer("sentencepiece");
  EXPECT_EQ(LoadDataset(config).status().message(),
            "unknown tokenizer \"sentencepiece\" (known: byte, gpt2)");
  config.set_tokenizer("gpt2");
  config.set_tokenizer_dir("/nonexistent");
  EXPECT_EQ(LoadDataset(config).status().message(),
            "GPT-2 tokenizer file \"/nonexistent/encoder.json\" not found "
            "(tools/setup.sh derives encoder.json and vocab.bpe from the npm "
            "tiktoken package into /usr/local/share/fsdpp/gpt2)");
  config.set_tokenizer("byte");
  config.set_validation_fraction(1.0);
  EXPECT_EQ(LoadDataset(config).status().message(),
            "data.validation_fraction must be in [0, 1), got 1");
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
