// Tests of the GPT-2 tokenizer: the hand-written pre-tokenizer against the
// regex's documented behaviour, BPE on a tiny hand-made vocabulary, the
// loader's consistency errors (exact text) and, when tools/setup.sh has
// installed them, token-for-token parity with the npm tiktoken package's
// "gpt2" encoding on a test corpus, the embedded corpus and a sweep over
// every Unicode scalar value.
#include "trainer/data/gpt2_tokenizer.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "formats/file_util.h"
#include "formats/json.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/data/corpus.h"

namespace fsdpp {
namespace trainer {
namespace {

using ::testing::ElementsAre;

std::vector<std::string> Pieces(absl::string_view text) {
  std::vector<std::string> pieces;
  for (absl::string_view piece : Gpt2PreTokenize(text)) {
    pieces.emplace_back(piece);
  }
  return pieces;
}

TEST(Gpt2PreTokenizeTest, WordsTakeTheirLeadingSpace) {
  EXPECT_THAT(Pieces("Hello world"), ElementsAre("Hello", " world"));
  EXPECT_THAT(Pieces(" leading"), ElementsAre(" leading"));
  EXPECT_THAT(Pieces(""), ElementsAre());
}

TEST(Gpt2PreTokenizeTest, Contractions) {
  EXPECT_THAT(Pieces("I'm don't we've they'll he'd it's you're"),
              ElementsAre("I", "'m", " don", "'t", " we", "'ve", " they", "'ll",
                          " he", "'d", " it", "'s", " you", "'re"));
  // Only lower case, and only right after the apostrophe.
  EXPECT_THAT(Pieces("I'M"), ElementsAre("I", "'", "M"));
  EXPECT_THAT(Pieces("'sup"), ElementsAre("'s", "up"));
  EXPECT_THAT(Pieces("''s"), ElementsAre("''", "s"));
  EXPECT_THAT(Pieces(" 's"), ElementsAre(" '", "s"));
  EXPECT_THAT(Pieces("x'"), ElementsAre("x", "'"));
}

TEST(Gpt2PreTokenizeTest, NumbersAndPunctuation) {
  EXPECT_THAT(Pieces(" 123abc 4.5"),
              ElementsAre(" 123", "abc", " 4", ".", "5"));
  EXPECT_THAT(Pieces("!!! ?x"), ElementsAre("!!!", " ?", "x"));
}

TEST(Gpt2PreTokenizeTest, WhitespaceLeavesItsLastSpaceToTheNextWord) {
  EXPECT_THAT(Pieces("a  b"), ElementsAre("a", " ", " b"));
  EXPECT_THAT(Pieces("a   b"), ElementsAre("a", "  ", " b"));
  EXPECT_THAT(Pieces("a\n\nb"), ElementsAre("a", "\n", "\n", "b"));
  EXPECT_THAT(Pieces("a \nb"), ElementsAre("a", " ", "\n", "b"));
  EXPECT_THAT(Pieces("a\tb"), ElementsAre("a", "\t", "b"));
  // At the end of the text the whole run is one piece.
  EXPECT_THAT(Pieces("a   "), ElementsAre("a", "   "));
  EXPECT_THAT(Pieces("a "), ElementsAre("a", " "));
  EXPECT_THAT(Pieces("\n\n"), ElementsAre("\n\n"));
}

TEST(Gpt2PreTokenizeTest, UnicodeClasses) {
  EXPECT_THAT(Pieces("naïve café"), ElementsAre("naïve", " café"));
  EXPECT_THAT(Pieces("日本語 текст"), ElementsAre("日本語", " текст"));
  EXPECT_THAT(Pieces("x٣٤ Ⅻ"), ElementsAre("x", "٣٤", " Ⅻ"));
  // A combining mark is neither a letter nor a number.
  EXPECT_THAT(Pieces("e\u0301"), ElementsAre("e", "\u0301"));
  // U+00A0 is whitespace (not the optional ' '); U+FEFF is not whitespace.
  EXPECT_THAT(Pieces("a\u00a0b"), ElementsAre("a", "\u00a0", "b"));
  EXPECT_THAT(Pieces("a\ufeffb"), ElementsAre("a", "\ufeff", "b"));
}

TEST(Gpt2PreTokenizeTest, InvalidUtf8BytesArePunctuation) {
  EXPECT_THAT(Pieces("a\xff\xfe b"), ElementsAre("a", "\xff\xfe", " b"));
}

TEST(Gpt2PreTokenizeTest, PiecesConcatenateToTheText) {
  std::string text;
  uint32_t state = 12345;
  const char alphabet[] = "ab 1'\n\t.!\xc3\xa9";
  for (int i = 0; i < 5000; ++i) {
    state = state * 1664525u + 1013904223u;
    text.push_back(alphabet[(state >> 16) % (sizeof(alphabet) - 1)]);
  }
  EXPECT_EQ(absl::StrJoin(Gpt2PreTokenize(text), ""), text);
}

// GPT-2's spelling of a byte string (bytes_to_unicode), as UTF-8.
std::string Spell(absl::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    int next = 256;
    int code_point = -1;
    for (int c = 0; c < 256; ++c) {
      const bool printable =
          (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
      const int cp = printable ? c : next++;
      if (c == b) code_point = cp;
    }
    if (code_point < 0x80) {
      out.push_back(static_cast<char>(code_point));
    } else {
      out.push_back(static_cast<char>(0xC0 | (code_point >> 6)));
      out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
    }
  }
  return out;
}

// A vocabulary of the 256 bytes (ids = byte values) plus `merges`, then EOT.
struct TinyVocab {
  std::string encoder_json;
  std::string vocab_bpe;
};

TinyVocab MakeVocab(
    const std::vector<std::pair<std::string, std::string>>& merges) {
  std::vector<std::string> entries;
  for (int b = 0; b < 256; ++b) {
    entries.push_back(absl::StrCat(
        JsonQuote(Spell(std::string(1, static_cast<char>(b)))), ": ", b));
  }
  TinyVocab vocab;
  vocab.vocab_bpe = "#version: 0.2\n";
  int id = 256;
  for (const auto& [left, right] : merges) {
    entries.push_back(absl::StrCat(JsonQuote(Spell(left + right)), ": ", id++));
    absl::StrAppend(&vocab.vocab_bpe, Spell(left), " ", Spell(right), "\n");
  }
  entries.push_back(absl::StrCat("\"<|endoftext|>\": ", id));
  vocab.encoder_json = absl::StrCat("{", absl::StrJoin(entries, ", "), "}");
  return vocab;
}

TEST(Gpt2TokenizerTest, MergesByRank) {
  const TinyVocab vocab =
      MakeVocab({{"a", "b"}, {"ab", "c"}, {" ", "a"}, {"b", "c"}});
  auto tokenizer =
      Gpt2Tokenizer::FromContents(vocab.encoder_json, vocab.vocab_bpe);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->vocab_size(), 261);
  EXPECT_EQ((*tokenizer)->eot_id(), 260);
  EXPECT_EQ((*tokenizer)->TokenId("ab"), 256);
  // "abc" is a token; " ab" is not: " a" (258) loses to "ab" (256);
  // " abc": "ab" first, then "abc"; "bcb": "bc" then "b".
  EXPECT_THAT((*tokenizer)->Encode("abc ab abc bcb"),
              ElementsAre(257, ' ', 256, ' ', 257, ' ', 259, 'b'));
  auto text = (*tokenizer)->Decode({257, ' ', 256, 260});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "abc ab<|endoftext|>");
  EXPECT_EQ((*tokenizer)->Decode({261}).status().message(),
            "gpt2 tokenizer: id 261 at position 0 is outside [0, 261)");
  // Leftmost merge on ties: "aaa" with "aa" gives "aa" + "a".
  const TinyVocab aa = MakeVocab({{"a", "a"}});
  auto tokenizer_aa =
      Gpt2Tokenizer::FromContents(aa.encoder_json, aa.vocab_bpe);
  ASSERT_TRUE(tokenizer_aa.ok()) << tokenizer_aa.status();
  EXPECT_THAT((*tokenizer_aa)->Encode("aaa"), ElementsAre(256, 'a'));
  EXPECT_THAT((*tokenizer_aa)->Encode("aaaa"), ElementsAre(256, 256));
}

TEST(Gpt2TokenizerTest, LoaderErrors) {
  const TinyVocab good = MakeVocab({{"a", "b"}});
  struct Case {
    std::string encoder_json;
    std::string vocab_bpe;
    std::string message;
  };
  std::string no_byte = good.encoder_json;  // "!" respelled.
  no_byte.replace(no_byte.find("\"!\": 33"), 7, "\"<|x|>\": 33");
  std::string twice = good.encoder_json;  // '"' with ids 33 and 34.
  twice.replace(twice.find("\"!\": 33"), 7, "\"\\\"\": 33");
  std::string duplicate_id = good.encoder_json;
  duplicate_id.replace(duplicate_id.find("\"!\": 33"), 7, "\"!\": 34");
  std::string large_id = good.encoder_json;
  large_id.replace(large_id.find("\"!\": 33"), 7, "\"!\": 999");
  const std::vector<Case> cases = {
      {"[1]", good.vocab_bpe, "encoder.json: expected a JSON object"},
      {"{", good.vocab_bpe, "encoder.json: at byte 1: unexpected end of input"},
      {no_byte, good.vocab_bpe,
       "encoder.json: no token for byte 0x21 (every byte needs one)"},
      {twice, good.vocab_bpe, "encoder.json: token \"\\\"\" appears twice"},
      {large_id, good.vocab_bpe,
       "encoder.json: id of token \"!\" is not an integer in [0, 258) (ids "
       "must be 0..n-1 for n tokens)"},
      {duplicate_id, good.vocab_bpe,
       "encoder.json: id 34 is given to both \"!\" and \"\\\"\""},
      {"{\"\xe4\xb8\x80\": 0}", "#version: 0.2\n",
       "encoder.json: token \"\xe4\xb8\x80\" uses U+4E00, which spells no "
       "byte in GPT-2's alphabet"},
      {good.encoder_json, "a b\n",
       "vocab.bpe line 1: expected a \"#version\" header"},
      {good.encoder_json, "#version: 0.2\n",
       "vocab.bpe has 0 merges but encoder.json has 257 ordinary tokens "
       "(expected 256 + 0)"},
      {good.encoder_json, "#version: 0.2\nab\n",
       "vocab.bpe line 2: expected \"left right\", got \"ab\""},
      {good.encoder_json, "#version: 0.2\nb a\n",
       "vocab.bpe line 2: merge \"b a\" makes a token missing from "
       "encoder.json, expected id 256"},
      {good.encoder_json, "#version: 0.2\nab a\n",
       "vocab.bpe line 2: merge \"ab a\" makes a token missing from "
       "encoder.json, expected id 256"},
      {good.encoder_json, "#version: 0.2\nxy a\n",
       "vocab.bpe line 2: \"xy\" is not a token of encoder.json"},
  };
  for (const Case& c : cases) {
    auto tokenizer = Gpt2Tokenizer::FromContents(c.encoder_json, c.vocab_bpe);
    ASSERT_FALSE(tokenizer.ok()) << c.message;
    EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(tokenizer.status().message()), c.message);
  }
}

TEST(Gpt2TokenizerTest, MissingDirectoryNamesTheFileAndTheFix) {
  auto tokenizer = Gpt2Tokenizer::LoadFromDirectory("/nonexistent/gpt2");
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tokenizer.status().message(),
            "GPT-2 tokenizer file \"/nonexistent/gpt2/encoder.json\" not found "
            "(tools/setup.sh derives encoder.json and vocab.bpe from the npm "
            "tiktoken package into /usr/local/share/fsdpp/gpt2)");
}

// --- Parity with tiktoken --------------------------------------------------

constexpr char kTiktokenDirectory[] =
    "/usr/local/share/fsdpp/node_modules/tiktoken";

class Gpt2ParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string missing =
        !IsRegularFile(absl::StrCat(kDefaultGpt2Directory, "/encoder.json"))
            ? absl::StrCat(kDefaultGpt2Directory, "/encoder.json")
        : !IsRegularFile(absl::StrCat(kTiktokenDirectory, "/package.json"))
            ? absl::StrCat(kTiktokenDirectory, "/package.json")
        : std::system("node --version > /dev/null 2>&1") != 0 ? "node"
                                                              : "";
    if (!missing.empty()) {
      GTEST_SKIP() << missing
                   << " not found: run tools/setup.sh (npm step) for the "
                      "GPT-2 files and the tiktoken reference";
    }
    auto tokenizer = Gpt2Tokenizer::LoadFromDirectory(kDefaultGpt2Directory);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
  }

  // tiktoken's ids for `text`, computed by node.
  std::vector<int32_t> Tiktoken(const std::string& text) {
    const std::string dir = std::getenv("TEST_TMPDIR");
    const std::string input = dir + "/tiktoken_input.txt";
    const std::string output = dir + "/tiktoken_output.bin";
    EXPECT_TRUE(WriteFileAtomically(input, text).ok());
    const std::string command =
        absl::StrCat("node trainer/data/testdata/tiktoken_encode.js ",
                     kTiktokenDirectory, " ", input, " ", output);
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    auto bytes = ReadFileToString(output);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    std::vector<int32_t> ids(bytes->size() / 4);
    std::memcpy(ids.data(), bytes->data(), ids.size() * 4);
    return ids;
  }

  void ExpectParity(const std::string& text) {
    const std::vector<int32_t> expected = Tiktoken(text);
    const std::vector<int32_t> actual = tokenizer_->Encode(text);
    size_t first = 0;
    while (first < expected.size() && first < actual.size() &&
           expected[first] == actual[first]) {
      ++first;
    }
    if (first < expected.size() || first < actual.size()) {
      const auto window = [&](const std::vector<int32_t>& ids) {
        const size_t begin = first >= 5 ? first - 5 : 0;
        const size_t end = std::min(ids.size(), first + 5);
        return absl::StrJoin(ids.begin() + begin, ids.begin() + end, " ");
      };
      ADD_FAILURE() << "first difference at token " << first << " of "
                    << expected.size() << " (tiktoken) / " << actual.size()
                    << " (ours)\n  tiktoken: " << window(expected)
                    << "\n  ours:     " << window(actual);
    }
    auto decoded = tokenizer_->Decode(actual);
    ASSERT_TRUE(decoded.ok());
    EXPECT_EQ(*decoded, text);
  }

  std::unique_ptr<Gpt2Tokenizer> tokenizer_;
};

TEST_F(Gpt2ParityTest, KnownIds) {
  EXPECT_EQ(tokenizer_->vocab_size(), 50257);
  EXPECT_EQ(tokenizer_->eot_id(), 50256);
  EXPECT_THAT(tokenizer_->Encode("Hello world"), ElementsAre(15496, 995));
}

TEST_F(Gpt2ParityTest, TestCorpus) {
  auto text = ReadFileToString("trainer/data/testdata/bpe_cases.txt");
  ASSERT_TRUE(text.ok()) << text.status();
  ExpectParity(*text);
}

TEST_F(Gpt2ParityTest, EmbeddedCorpus) {
  ExpectParity(std::string(EmbeddedCorpus()));
}

// Every Unicode scalar value after a letter, after a space and before a
// digit: any difference between our class tables and tiktoken's regex shows.
TEST_F(Gpt2ParityTest, EveryCodePoint) {
  std::string text;
  text.reserve(18 << 20);
  for (int32_t cp = 1; cp <= 0x10FFFF; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    char utf8[4];
    int length;
    if (cp < 0x80) {
      utf8[0] = static_cast<char>(cp);
      length = 1;
    } else if (cp < 0x800) {
      utf8[0] = static_cast<char>(0xC0 | (cp >> 6));
      utf8[1] = static_cast<char>(0x80 | (cp & 0x3F));
      length = 2;
    } else if (cp < 0x10000) {
      utf8[0] = static_cast<char>(0xE0 | (cp >> 12));
      utf8[1] = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      utf8[2] = static_cast<char>(0x80 | (cp & 0x3F));
      length = 3;
    } else {
      utf8[0] = static_cast<char>(0xF0 | (cp >> 18));
      utf8[1] = static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      utf8[2] = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      utf8[3] = static_cast<char>(0x80 | (cp & 0x3F));
      length = 4;
    }
    const absl::string_view c(utf8, length);
    absl::StrAppend(&text, "a", c, " ", c, "1", c, "\n");
  }
  ExpectParity(text);
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
