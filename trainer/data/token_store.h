// A read-only token sequence for the loader: either tokens in memory (a
// tokenized text) or a memory-mapped llm.c shard, behind one interface.
//
// Tokens are read out as int32 (the model's id type) whatever the storage, so
// the loader and its tests do not care where the ids came from. A store is
// immutable and shared (shared_ptr) between the train and validation loaders.
#ifndef FSDPP_TRAINER_DATA_TOKEN_STORE_H_
#define FSDPP_TRAINER_DATA_TOKEN_STORE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "trainer/data/token_file.h"

namespace fsdpp {
namespace trainer {

// Immutable tokens with random access.
class TokenStore {
 public:
  // Tokens held in memory.
  static std::shared_ptr<const TokenStore> FromVector(
      std::vector<int32_t> tokens);
  // Tokens held in memory with a loss mask: loss_mask[i] != 0 when token i
  // is trained as a target (an SFT completion), 0 when it is only context
  // (a prompt); an empty mask is none. CHECK-fails unless the mask is empty
  // or as long as the tokens.
  static std::shared_ptr<const TokenStore> FromVector(
      std::vector<int32_t> tokens, std::vector<uint8_t> loss_mask);

  // The tokens of a mapped shard (kept alive by the store).
  static std::shared_ptr<const TokenStore> FromFile(
      std::unique_ptr<TokenFile> file);

  // Number of tokens.
  int64_t size() const { return size_; }

  // Copies tokens [begin, begin + count) to out; CHECK-fails outside
  // [0, size()).
  void Read(int64_t begin, int64_t count, int32_t* out) const;

  // The largest token id (-1 when empty); computed once at construction.
  int32_t max_token() const { return max_token_; }

  // Whether the store has a loss mask (else every token is a target).
  bool has_loss_mask() const { return !loss_mask_.empty(); }
  // Whether token i is a loss target (true without a mask).
  bool IsLossTarget(int64_t i) const {
    return loss_mask_.empty() || loss_mask_[i] != 0;
  }
  // The loss targets among tokens [begin, begin + count); CHECK-fails
  // outside [0, size()).
  int64_t CountLossTargets(int64_t begin, int64_t count) const;

 private:
  TokenStore() = default;

  std::vector<int32_t> memory_;
  std::vector<uint8_t> loss_mask_;  // Empty: every token.
  std::unique_ptr<TokenFile> file_;
  int64_t size_ = 0;
  int32_t max_token_ = -1;
};

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_TOKEN_STORE_H_
