// Chat / SFT examples and their packing; see sft.h.
#include "trainer/data/sft.h"

#include <cctype>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "formats/json.h"
#include "trainer/data/corpus.h"

namespace fsdpp {
namespace trainer {
namespace {

absl::Status LineError(absl::string_view where, int64_t line,
                       absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat(where, " line ", line, ": ", problem));
}

// The rendered header of a message of `role`; empty for an unknown role.
std::string Header(absl::string_view role) {
  if (role == "system") return "System: ";
  if (role == "user") return "User: ";
  if (role == "assistant") return "Assistant: ";
  return "";
}

// A string member `key` of `object`, or an error naming it.
absl::StatusOr<const std::string*> StringMember(const Json& object,
                                                absl::string_view key,
                                                absl::string_view where,
                                                int64_t line) {
  const Json* value = object.Find(key);
  if (value == nullptr || !value->is_string()) {
    return LineError(
        where, line,
        absl::StrCat(
            "\"", key, "\" must be a string, got ",
            value == nullptr ? "nothing" : Json::TypeName(value->type())));
  }
  return &value->string_value();
}

absl::StatusOr<SftExample> ParseExample(const Json& json,
                                        absl::string_view where, int64_t line) {
  if (!json.is_object()) {
    return LineError(where, line,
                     absl::StrCat("an example must be a JSON object, got ",
                                  Json::TypeName(json.type())));
  }
  const Json* messages = json.Find("messages");
  const bool pair =
      json.Find("prompt") != nullptr || json.Find("completion") != nullptr;
  if ((messages != nullptr) == pair) {
    return LineError(where, line,
                     "an example has either \"prompt\" and \"completion\" "
                     "or \"messages\"");
  }
  SftExample example;
  if (pair) {
    absl::StatusOr<const std::string*> prompt =
        StringMember(json, "prompt", where, line);
    if (!prompt.ok()) return prompt.status();
    absl::StatusOr<const std::string*> completion =
        StringMember(json, "completion", where, line);
    if (!completion.ok()) return completion.status();
    if ((*completion)->empty()) {
      return LineError(where, line,
                       "the completion is empty: nothing to "
                       "train on");
    }
    example.segments = {{**prompt, false}, {**completion, true}};
    return example;
  }
  if (!messages->is_array() || messages->array_value().empty()) {
    return LineError(where, line,
                     "\"messages\" must be a non-empty array of {\"role\", "
                     "\"content\"} objects");
  }
  bool trains = false;
  int64_t index = 0;
  for (const Json& message : messages->array_value()) {
    const std::string at = absl::StrCat("message ", index++, ": ");
    if (!message.is_object()) {
      return LineError(where, line,
                       absl::StrCat(at, "must be an object, got ",
                                    Json::TypeName(message.type())));
    }
    absl::StatusOr<const std::string*> role =
        StringMember(message, "role", where, line);
    if (!role.ok()) return role.status();
    const std::string header = Header(**role);
    if (header.empty()) {
      return LineError(where, line,
                       absl::StrCat(at, "role \"", **role,
                                    "\" is not system, user or assistant"));
    }
    absl::StatusOr<const std::string*> content =
        StringMember(message, "content", where, line);
    if (!content.ok()) return content.status();
    const bool assistant = **role == "assistant";
    trains = trains || (assistant && !(*content)->empty());
    example.segments.push_back({header, false});
    example.segments.push_back({**content, assistant});
    example.segments.push_back({"\n", assistant});
  }
  if (!trains) {
    return LineError(where, line,
                     "no assistant message with content: nothing to train on");
  }
  return example;
}

// Whether `head` is a dictionary headword: capitals, spaces, hyphens and
// apostrophes, beginning with a capital.
bool IsHeadword(absl::string_view head) {
  if (head.empty() || !absl::ascii_isupper(head[0])) return false;
  for (char c : head) {
    if (!absl::ascii_isupper(c) && c != ' ' && c != '-' && c != '\'') {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<SftExample>> ParseSftJsonl(absl::string_view text,
                                                      absl::string_view where) {
  std::vector<SftExample> examples;
  int64_t line = 0;
  for (absl::string_view row : absl::StrSplit(text, '\n')) {
    ++line;
    row = absl::StripTrailingAsciiWhitespace(row);
    if (absl::StripLeadingAsciiWhitespace(row).empty()) continue;
    absl::StatusOr<Json> json = ParseJson(row);
    if (!json.ok()) {
      return LineError(where, line,
                       absl::StrCat("not JSON: ", json.status().message()));
    }
    absl::StatusOr<SftExample> example = ParseExample(*json, where, line);
    if (!example.ok()) return example.status();
    examples.push_back(*std::move(example));
  }
  if (examples.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": no examples (one JSON object per line)"));
  }
  return examples;
}

std::vector<SftExample> EmbeddedChatExamples() {
  // Entries are paragraphs "WORD, pos.  Definition ..." (wrapped lines);
  // quotations and verses after them are indented paragraphs of their own.
  static constexpr const char* kAsk[] = {"What is ", "Define ", "What does "};
  static constexpr const char* kEnd[] = {"?", ".", " mean?"};
  std::vector<SftExample> examples;
  for (absl::string_view paragraph :
       absl::StrSplit(EmbeddedCorpus(), "\n\n", absl::SkipWhitespace())) {
    paragraph = absl::StripLeadingAsciiWhitespace(paragraph);
    const size_t comma = paragraph.find(", ");
    if (comma == absl::string_view::npos) continue;
    const absl::string_view head = paragraph.substr(0, comma);
    if (!IsHeadword(head)) continue;
    const size_t gap = paragraph.find("  ", comma + 2);
    if (gap == absl::string_view::npos) continue;
    const absl::string_view pos = paragraph.substr(comma + 2, gap - comma - 2);
    if (pos.empty() || pos.size() > 8 || pos.back() != '.') continue;
    std::vector<absl::string_view> lines =
        absl::StrSplit(absl::StripAsciiWhitespace(paragraph.substr(gap)), '\n');
    for (absl::string_view& l : lines) l = absl::StripAsciiWhitespace(l);
    const std::string definition = absl::StrJoin(lines, " ");
    if (definition.empty()) continue;
    std::string word = absl::AsciiStrToLower(head);
    word[0] = absl::ascii_toupper(word[0]);
    const size_t turn = examples.size() % 3;
    SftExample example;
    example.segments = {
        {"User: ", false},  {absl::StrCat(kAsk[turn], word, kEnd[turn]), false},
        {"\n", false},      {"Assistant: ", false},
        {definition, true}, {"\n", true},
    };
    examples.push_back(std::move(example));
  }
  return examples;
}

std::string EmbeddedChatDescription() {
  return "embedded chat set (questions on the entries of the embedded "
         "corpus, The Devil's Dictionary, answered with their definitions)";
}

absl::StatusOr<SftTokens> PackSft(const Tokenizer& tokenizer,
                                  absl::Span<const SftExample> examples) {
  if (tokenizer.eot_id() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SFT data needs a tokenizer with an end-of-text token "
                     "between examples; ",
                     tokenizer.name(), " has none"));
  }
  if (examples.empty()) {
    return absl::InvalidArgumentError("SFT data: no examples");
  }
  SftTokens out;
  bool last_trained = false;
  const auto add = [&](int32_t token, bool trained) {
    out.tokens.push_back(token);
    out.loss_mask.push_back(trained ? 1 : 0);
    out.trained += trained;
  };
  for (const SftExample& example : examples) {
    add(tokenizer.eot_id(), last_trained);
    for (const SftSegment& segment : example.segments) {
      for (int32_t token : tokenizer.Encode(segment.text)) {
        add(token, segment.trained);
      }
      if (!segment.text.empty()) last_trained = segment.trained;
    }
    ++out.examples;
  }
  // The last example ends as the others do, on an end-of-text token.
  add(tokenizer.eot_id(), last_trained);
  return out;
}

}  // namespace trainer
}  // namespace fsdpp
