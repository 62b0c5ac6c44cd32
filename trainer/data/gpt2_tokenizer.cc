// GPT-2 byte-level BPE: the hand-written pre-tokenizer, the file loader with
// its consistency checks and tiktoken's rank-ordered byte pair merge.
#include "trainer/data/gpt2_tokenizer.h"

#include <cstdint>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "formats/json.h"
#include "trainer/data/unicode.h"

namespace fsdpp {
namespace trainer {
namespace {

// What the pre-tokenizer pattern distinguishes about a code point.
enum class CharClass { kLetter, kNumber, kWhiteSpace, kOther };

CharClass Classify(int32_t code_point) {
  if (IsLetter(code_point)) return CharClass::kLetter;
  if (IsNumber(code_point)) return CharClass::kNumber;
  if (IsWhiteSpace(code_point)) return CharClass::kWhiteSpace;
  return CharClass::kOther;  // Also invalid UTF-8 bytes.
}

// GPT-2's bytes_to_unicode: the code point that spells each byte in
// encoder.json and vocab.bpe. Printable Latin-1 bytes spell themselves; the
// other 68 map to U+0100.. in byte order.
struct ByteAlphabet {
  int32_t code_point_of[256];
  int16_t byte_of[512];  // -1 for code points that spell no byte.

  ByteAlphabet() {
    for (int16_t& b : byte_of) b = -1;
    int32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      code_point_of[b] = printable ? b : next++;
      byte_of[code_point_of[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet* alphabet = new ByteAlphabet();
  return *alphabet;
}

std::string Quoted(absl::string_view text) {
  return absl::StrCat("\"", absl::Utf8SafeCEscape(text), "\"");
}

// The bytes a token spelled in GPT-2's byte alphabet stands for.
absl::StatusOr<std::string> SpellingToBytes(absl::string_view spelling) {
  const ByteAlphabet& alphabet = Alphabet();
  std::string bytes;
  size_t pos = 0;
  while (pos < spelling.size()) {
    int32_t code_point;
    pos += DecodeUtf8(spelling, pos, &code_point);
    if (code_point < 0 || code_point >= 512 ||
        alphabet.byte_of[code_point] < 0) {
      return absl::InvalidArgumentError(
          code_point < 0
              ? absl::StrCat("token ", Quoted(spelling), " is not valid UTF-8")
              : absl::StrCat("token ", Quoted(spelling),
                             absl::StrFormat(" uses U+%04X", code_point),
                             ", which spells no byte in GPT-2's alphabet"));
    }
    bytes.push_back(static_cast<char>(alphabet.byte_of[code_point]));
  }
  if (bytes.empty()) {
    return absl::InvalidArgumentError("empty token");
  }
  return bytes;
}

constexpr int32_t kNoRank = std::numeric_limits<int32_t>::max();
constexpr char kEndOfText[] = "<|endoftext|>";

}  // namespace

std::vector<absl::string_view> Gpt2PreTokenize(absl::string_view text) {
  // Code points with their byte offsets (offsets[n] = text.size()).
  std::vector<int32_t> code_points;
  std::vector<size_t> offsets;
  code_points.reserve(text.size());
  offsets.reserve(text.size() + 1);
  for (size_t pos = 0; pos < text.size();) {
    int32_t code_point;
    const int length = DecodeUtf8(text, pos, &code_point);
    code_points.push_back(code_point);
    offsets.push_back(pos);
    pos += static_cast<size_t>(length);
  }
  offsets.push_back(text.size());
  const size_t n = code_points.size();
  std::vector<CharClass> classes(n);
  for (size_t i = 0; i < n; ++i) classes[i] = Classify(code_points[i]);

  std::vector<absl::string_view> pieces;
  size_t i = 0;
  const auto emit = [&](size_t end) {
    pieces.push_back(text.substr(offsets[i], offsets[end] - offsets[i]));
    i = end;
  };
  while (i < n) {
    // 's|'t|'re|'ve|'m|'ll|'d
    if (code_points[i] == '\'' && i + 1 < n) {
      const int32_t c1 = code_points[i + 1];
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        emit(i + 2);
        continue;
      }
      if (i + 2 < n) {
        const int32_t c2 = code_points[i + 2];
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
            (c1 == 'l' && c2 == 'l')) {
          emit(i + 3);
          continue;
        }
      }
    }
    // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`: an optional space (U+0020
    // only), then a run of one class. A space followed by whitespace or by
    // nothing matches none of them.
    const size_t start = (code_points[i] == ' ' && i + 1 < n) ? i + 1 : i;
    const CharClass run_class = classes[start];
    if (run_class != CharClass::kWhiteSpace) {
      size_t end = start + 1;
      while (end < n && classes[end] == run_class) ++end;
      emit(end);
      continue;
    }
    // `\s+(?!\S)|\s+`: the whitespace run, less its last character when a
    // non-space follows and the run is longer than one.
    size_t end = i + 1;
    while (end < n && classes[end] == CharClass::kWhiteSpace) ++end;
    if (end < n && end - i >= 2) --end;
    emit(end);
  }
  return pieces;
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::LoadFromDirectory(
    const std::string& directory) {
  const std::string encoder_path = absl::StrCat(directory, "/encoder.json");
  const std::string merges_path = absl::StrCat(directory, "/vocab.bpe");
  for (const std::string& path : {encoder_path, merges_path}) {
    if (!IsRegularFile(path)) {
      return absl::NotFoundError(absl::StrCat(
          "GPT-2 tokenizer file \"", path,
          "\" not found (tools/setup.sh derives encoder.json and vocab.bpe "
          "from the npm tiktoken package into ",
          kDefaultGpt2Directory, ")"));
    }
  }
  FSDPP_ASSIGN_OR_RETURN(std::string encoder_json,
                         ReadFileToString(encoder_path, "GPT-2 encoder"));
  FSDPP_ASSIGN_OR_RETURN(std::string vocab_bpe,
                         ReadFileToString(merges_path, "GPT-2 merges"));
  return FromContents(encoder_json, vocab_bpe, encoder_path, merges_path);
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::FromContents(
    absl::string_view encoder_json, absl::string_view vocab_bpe,
    absl::string_view encoder_name, absl::string_view merges_name) {
  const auto encoder_error = [&](absl::string_view message) {
    return absl::InvalidArgumentError(
        absl::StrCat(encoder_name, ": ", message));
  };
  absl::StatusOr<Json> parsed = ParseJson(encoder_json);
  if (!parsed.ok()) return encoder_error(parsed.status().message());
  if (!parsed->is_object()) return encoder_error("expected a JSON object");
  const Json::Object& entries = parsed->object_value();
  const size_t count = entries.size();
  if (count > static_cast<size_t>(kNoRank)) {
    return encoder_error("too many tokens");
  }

  std::unique_ptr<Gpt2Tokenizer> tokenizer(new Gpt2Tokenizer());
  tokenizer->token_bytes_.resize(count);
  std::vector<const std::string*> owner(count, nullptr);  // For errors.
  for (const auto& [spelling, value] : entries) {
    if (!value.is_int64() || value.int64_value() < 0 ||
        value.int64_value() >= static_cast<int64_t>(count)) {
      return encoder_error(absl::StrCat("id of token ", Quoted(spelling),
                                        " is not an integer in [0, ", count,
                                        ") (ids must be 0..n-1 for n tokens)"));
    }
    const int32_t id = static_cast<int32_t>(value.int64_value());
    if (owner[id] != nullptr) {
      return encoder_error(absl::StrCat("id ", id, " is given to both ",
                                        Quoted(*owner[id]), " and ",
                                        Quoted(spelling)));
    }
    owner[id] = &spelling;
    if (spelling == kEndOfText) {
      tokenizer->eot_id_ = id;
      tokenizer->token_bytes_[id] = kEndOfText;
      continue;
    }
    absl::StatusOr<std::string> bytes = SpellingToBytes(spelling);
    if (!bytes.ok()) return encoder_error(bytes.status().message());
    if (!tokenizer->ranks_.emplace(*bytes, id).second) {
      return encoder_error(
          absl::StrCat("token ", Quoted(spelling), " appears twice"));
    }
    tokenizer->token_bytes_[id] = *std::move(bytes);
  }
  for (int b = 0; b < 256; ++b) {
    if (!tokenizer->ranks_.contains(std::string(1, static_cast<char>(b)))) {
      return encoder_error(absl::StrCat("no token for byte 0x",
                                        absl::Hex(b, absl::kZeroPad2),
                                        " (every byte needs one)"));
    }
  }

  // vocab.bpe: merge i (0-based) must make the token with id 256 + i.
  std::vector<absl::string_view> lines = absl::StrSplit(vocab_bpe, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (lines.empty() || !absl::StartsWith(lines[0], "#version")) {
    return absl::InvalidArgumentError(
        absl::StrCat(merges_name, " line 1: expected a \"#version\" header"));
  }
  const int64_t merges = static_cast<int64_t>(lines.size()) - 1;
  const int64_t ordinary = static_cast<int64_t>(tokenizer->ranks_.size());
  if (ordinary != 256 + merges) {
    return absl::InvalidArgumentError(absl::StrCat(
        merges_name, " has ", merges, " merges but ", encoder_name, " has ",
        ordinary, " ordinary tokens (expected 256 + ", merges, ")"));
  }
  for (int64_t i = 0; i < merges; ++i) {
    const absl::string_view line = lines[i + 1];
    const std::string where = absl::StrCat(merges_name, " line ", i + 2, ": ");
    const std::vector<absl::string_view> sides = absl::StrSplit(line, ' ');
    if (sides.size() != 2 || sides[0].empty() || sides[1].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "expected \"left right\", got ", Quoted(line)));
    }
    std::string merged;
    for (absl::string_view side : sides) {
      absl::StatusOr<std::string> bytes = SpellingToBytes(side);
      if (!bytes.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, bytes.status().message()));
      }
      if (!tokenizer->ranks_.contains(*bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, Quoted(side), " is not a token of ", encoder_name));
      }
      merged += *bytes;
    }
    const auto it = tokenizer->ranks_.find(merged);
    const int64_t expected = 256 + i;
    if (it == tokenizer->ranks_.end() || it->second != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "merge ", Quoted(line), " makes ",
                       it == tokenizer->ranks_.end()
                           ? absl::StrCat("a token missing from ", encoder_name)
                           : absl::StrCat("the token with id ", it->second),
                       ", expected id ", expected));
    }
  }
  return tokenizer;
}

std::vector<int32_t> Gpt2Tokenizer::Encode(absl::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  for (absl::string_view piece : Gpt2PreTokenize(text)) {
    EncodePiece(piece, &ids);
  }
  return ids;
}

void Gpt2Tokenizer::EncodePiece(absl::string_view piece,
                                std::vector<int32_t>* ids) const {
  const auto whole = ranks_.find(piece);
  if (whole != ranks_.end()) {
    ids->push_back(whole->second);
    return;
  }
  // tiktoken's byte_pair_merge: parts[k] = (start of part k, rank of the
  // concatenation of parts k and k + 1); two sentinels at the end.
  const auto rank_of = [&](size_t begin, size_t end) {
    const auto it = ranks_.find(piece.substr(begin, end - begin));
    return it == ranks_.end() ? kNoRank : it->second;
  };
  std::vector<std::pair<size_t, int32_t>> parts;
  parts.reserve(piece.size() + 1);
  for (size_t i = 0; i + 1 < piece.size(); ++i) {
    parts.emplace_back(i, rank_of(i, i + 2));
  }
  parts.emplace_back(piece.size() - 1, kNoRank);
  parts.emplace_back(piece.size(), kNoRank);
  // Rank of parts k, k + 1 as if k + 1 and k + 2 were already joined.
  const auto joined_rank = [&](size_t k) {
    return k + 3 < parts.size() ? rank_of(parts[k].first, parts[k + 3].first)
                                : kNoRank;
  };
  for (;;) {
    size_t best = 0;
    int32_t best_rank = kNoRank;
    for (size_t k = 0; k + 1 < parts.size(); ++k) {
      if (parts[k].second < best_rank) {
        best_rank = parts[k].second;
        best = k;
      }
    }
    if (best_rank == kNoRank) break;
    if (best > 0) parts[best - 1].second = joined_rank(best - 1);
    parts[best].second = joined_rank(best);
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  for (size_t k = 0; k + 1 < parts.size(); ++k) {
    ids->push_back(ranks_.at(
        piece.substr(parts[k].first, parts[k + 1].first - parts[k].first)));
  }
}

absl::StatusOr<std::string> Gpt2Tokenizer::Decode(
    absl::Span<const int32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpt2 tokenizer: id ", id, " at position ", i,
                       " is outside [0, ", vocab_size(), ")"));
    }
    text += token_bytes_[id];
  }
  return text;
}

int32_t Gpt2Tokenizer::TokenId(absl::string_view bytes) const {
  const auto it = ranks_.find(bytes);
  return it == ranks_.end() ? -1 : it->second;
}

}  // namespace trainer
}  // namespace fsdpp
