// Chat / SFT data: examples of prompt and completion (or of chat messages)
// turned into packed tokens with a loss mask, so that a fine-tuning run
// trains on the answers only.
//
// JSONL, one example per line (blank lines skipped), either
//   {"prompt": "...", "completion": "..."}            (TRL's prompt-completion)
//   {"messages": [{"role": "user", "content": "..."},
//                 {"role": "assistant", "content": "..."}, ...]}
// Roles are system, user and assistant. Messages are rendered with a plain
// text template, one line per message, "<Role>: <content>\n" (Role
// capitalised: "System: ", "User: ", "Assistant: "); a prompt and completion
// are the two strings as they are, one after the other (TRL's convention:
// the prompt ends where the completion begins). Every piece is tokenized on
// its own, so a boundary between prompt and answer is a token boundary.
//
// Trained (loss-mask 1) are the completion and each assistant message's
// content with its "\n"; the rest (prompts, system and user messages, the
// "Assistant: " header) is context, masked out of the loss. An example must
// train on something (a non-empty completion, an assistant message with
// content).
//
// Packing: the examples, in order, as documents in llm.c's layout -- each
// is the tokenizer's end-of-text token then its tokens, and one more
// end-of-text token ends the last -- so document masking keeps them apart.
// An end-of-text token is trained when the example before it ended on
// trained tokens (the model learns to stop after an answer).
#ifndef FSDPP_TRAINER_DATA_SFT_H_
#define FSDPP_TRAINER_DATA_SFT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "trainer/data/tokenizer.h"

namespace fsdpp {
namespace trainer {

// A piece of an example's text and whether it is trained on.
struct SftSegment {
  std::string text;
  bool trained = false;
};

// One example: its pieces in order (already rendered).
struct SftExample {
  std::vector<SftSegment> segments;
};

// The examples of a JSONL text (`where` names it in errors). InvalidArgument
// naming the line (1-based) for a line that is not a JSON object of one of
// the two forms, a role other than system, user or assistant, a content or
// prompt that is not a string, or an example with nothing to train on; and
// for a text without examples.
absl::StatusOr<std::vector<SftExample>> ParseSftJsonl(absl::string_view text,
                                                      absl::string_view where);

// A chat set made from the embedded corpus (trainer/data/corpus.h): one
// example per dictionary entry, a user asking what the word means ("What
// is X?", "Define X.", "What does X mean?" in turn) and the assistant
// answering with the entry's definition (its first paragraph). The same
// examples every call.
std::vector<SftExample> EmbeddedChatExamples();
// One line naming the embedded chat set.
std::string EmbeddedChatDescription();

// Packed tokens and their loss mask (1: trained), as a TokenStore takes
// them.
struct SftTokens {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;
  int64_t examples = 0;
  // Tokens whose mask is 1.
  int64_t trained = 0;
};

// Packs `examples` (see the file comment). InvalidArgument when the
// tokenizer has no end-of-text token (the examples could not be told apart)
// or there are no examples.
absl::StatusOr<SftTokens> PackSft(const Tokenizer& tokenizer,
                                  absl::Span<const SftExample> examples);

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_SFT_H_
