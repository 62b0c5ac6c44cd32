// SFT data: the JSONL forms and their errors, the packing's tokens and loss
// mask, the embedded chat set, and the loader's masked targets and step
// counts over data-parallel ranks.
#include "trainer/data/sft.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "trainer/data/byte_tokenizer.h"
#include "trainer/data/loader.h"
#include "trainer/data/token_store.h"

namespace fsdpp {
namespace trainer {
namespace {

TEST(SftTest, ParsesBothFormsAndRendersMessages) {
  absl::StatusOr<std::vector<SftExample>> examples = ParseSftJsonl(
      "{\"prompt\": \"2+2=\", \"completion\": \"4\"}\n"
      "\n"
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
      " {\"role\": \"user\", \"content\": \"Hi\"},"
      " {\"role\": \"assistant\", \"content\": \"Hello\"}]}\n",
      "chat.jsonl");
  ASSERT_TRUE(examples.ok()) << examples.status();
  ASSERT_EQ(examples->size(), 2u);
  const std::vector<SftSegment>& pair = (*examples)[0].segments;
  ASSERT_EQ(pair.size(), 2u);
  EXPECT_EQ(pair[0].text, "2+2=");
  EXPECT_FALSE(pair[0].trained);
  EXPECT_EQ(pair[1].text, "4");
  EXPECT_TRUE(pair[1].trained);
  std::string rendered, trained;
  for (const SftSegment& s : (*examples)[1].segments) {
    rendered += s.text;
    if (s.trained) trained += s.text;
  }
  EXPECT_EQ(rendered, "System: Be brief.\nUser: Hi\nAssistant: Hello\n");
  EXPECT_EQ(trained, "Hello\n");
}

TEST(SftTest, BadLinesAreNamed) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"prompt\": \"a\"", "line 1: not JSON"},
      {"\n[1, 2]", "line 2: an example must be a JSON object, got array"},
      {"{\"prompt\": \"a\", \"completion\": \"b\", \"messages\": []}",
       "either \"prompt\" and \"completion\" or \"messages\""},
      {"{\"prompt\": \"a\"}", "\"completion\" must be a string, got nothing"},
      {"{\"prompt\": 3, \"completion\": \"b\"}",
       "\"prompt\" must be a string, got number"},
      {"{\"prompt\": \"a\", \"completion\": \"\"}", "the completion is empty"},
      {"{\"messages\": []}", "must be a non-empty array"},
      {"{\"messages\": [{\"role\": \"bot\", \"content\": \"x\"}]}",
       "message 0: role \"bot\" is not system, user or assistant"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}",
       "no assistant message with content"},
      {"{\"messages\": [{\"role\": \"assistant\", \"content\": null}]}",
       "\"content\" must be a string, got null"},
      {"\n\n", "no examples"},
  };
  for (const auto& [text, expected] : cases) {
    absl::StatusOr<std::vector<SftExample>> r = ParseSftJsonl(text, "d.jsonl");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(r.status().message(), expected))
        << r.status() << " for " << text;
    EXPECT_TRUE(absl::StrContains(r.status().message(), "d.jsonl"));
  }
}

TEST(SftTest, PacksExamplesAsDocumentsWithTheirMask) {
  ByteTokenizer bytes;
  const std::vector<SftExample> examples = {
      {{{"ab", false}, {"c", true}}},
      {{{"d", false}, {"ef", true}, {"g", false}}},
      {{{"h", false}, {"i", true}}},
  };
  absl::StatusOr<SftTokens> packed = PackSft(bytes, examples);
  ASSERT_TRUE(packed.ok()) << packed.status();
  const int32_t e = bytes.eot_id();
  EXPECT_EQ(packed->tokens, (std::vector<int32_t>{e, 'a', 'b', 'c', e, 'd', 'e',
                                                  'f', 'g', e, 'h', 'i', e}));
  // The EOT after an example that ended on its answer is trained; after
  // one that ended on context ("g") it is not.
  EXPECT_EQ(packed->loss_mask,
            (std::vector<uint8_t>{0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1}));
  EXPECT_EQ(packed->examples, 3);
  EXPECT_EQ(packed->trained, 6);
  EXPECT_EQ(PackSft(ByteTokenizer(false), examples).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PackSft(bytes, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SftTest, TheEmbeddedChatSetAsksForTheDictionarysDefinitions) {
  const std::vector<SftExample> examples = EmbeddedChatExamples();
  EXPECT_GT(examples.size(), 800u);
  bool found = false;
  for (const SftExample& example : examples) {
    ASSERT_EQ(example.segments.size(), 6u);
    EXPECT_EQ(example.segments[0].text, "User: ");
    EXPECT_EQ(example.segments[3].text, "Assistant: ");
    EXPECT_TRUE(example.segments[4].trained);
    EXPECT_FALSE(example.segments[1].trained);
    EXPECT_FALSE(example.segments[4].text.empty());
    if (absl::StrContains(example.segments[1].text, "Accord") &&
        !absl::StrContains(example.segments[1].text, "Accordion")) {
      EXPECT_EQ(example.segments[4].text, "Harmony.");
      found = true;
    }
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(EmbeddedChatExamples().size(), examples.size());
  EXPECT_TRUE(absl::StrContains(EmbeddedChatDescription(), "embedded chat"));
}

// Masked tokens are ignored targets; LossTargetsAhead is the step's count
// over every rank's next batches, across an epoch's end, without moving.
TEST(SftTest, TheLoaderIgnoresContextAndCountsAStepsTargets) {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  for (int i = 0; i < 200; ++i) {
    tokens.push_back(i % 50);
    mask.push_back((i * 7) % 5 < 2 ? 1 : 0);
  }
  std::shared_ptr<const TokenStore> store =
      TokenStore::FromVector(tokens, mask);
  ASSERT_TRUE(store->has_loss_mask());
  EXPECT_FALSE(TokenStore::FromVector(tokens)->has_loss_mask());
  constexpr int kRanks = 2;
  std::vector<std::unique_ptr<DataLoader>> loaders;
  for (int r = 0; r < kRanks; ++r) {
    LoaderOptions o;
    o.seq_len = 8;
    o.batch_size = 3;
    o.dp_rank = r;
    o.dp_world = kRanks;
    o.seed = 4;
    absl::StatusOr<std::unique_ptr<DataLoader>> l =
        DataLoader::Create(store, 0, 200, o);
    ASSERT_TRUE(l.ok()) << l.status();
    loaders.push_back(*std::move(l));
  }
  // 24 windows, 4 batches of 3 rows x 2 ranks per epoch: 7 steps of 2
  // batches cross epoch ends.
  for (int step = 0; step < 7; ++step) {
    const int64_t ahead = loaders[0]->LossTargetsAhead(2);
    EXPECT_EQ(loaders[1]->LossTargetsAhead(2), ahead);
    int64_t counted = 0;
    for (int b = 0; b < 2; ++b) {
      for (auto& loader : loaders) {
        const Batch batch = loader->Next();
        for (int64_t i = 0; i < batch.batch_size * batch.seq_len; ++i) {
          const int64_t row = i / batch.seq_len, col = i % batch.seq_len;
          const int64_t token =
              loader->WindowStart(batch.windows[row]) + 1 + col;
          if (mask[token]) {
            EXPECT_EQ(batch.targets[i], tokens[token]);
            ++counted;
          } else {
            EXPECT_EQ(batch.targets[i], kIgnoredTarget);
          }
          EXPECT_EQ(batch.inputs[i], tokens[token - 1]);
        }
      }
    }
    EXPECT_EQ(counted, ahead) << "step " << step;
  }
  LoaderOptions plain;
  plain.seq_len = 8;
  plain.batch_size = 3;
  absl::StatusOr<std::unique_ptr<DataLoader>> unmasked =
      DataLoader::Create(TokenStore::FromVector(tokens), 0, 200, plain);
  ASSERT_TRUE(unmasked.ok());
  EXPECT_EQ((*unmasked)->LossTargetsAhead(5), 5 * 3 * 8);
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
