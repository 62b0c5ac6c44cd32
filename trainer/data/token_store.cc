// TokenStore over an int32 vector or a uint16 mapped shard.
#include "trainer/data/token_store.h"

#include <algorithm>
#include <utility>

#include "core/logging.h"

namespace fsdpp {
namespace trainer {

std::shared_ptr<const TokenStore> TokenStore::FromVector(
    std::vector<int32_t> tokens) {
  return FromVector(std::move(tokens), {});
}

std::shared_ptr<const TokenStore> TokenStore::FromVector(
    std::vector<int32_t> tokens, std::vector<uint8_t> loss_mask) {
  CHECK(loss_mask.empty() || loss_mask.size() == tokens.size())
      << "TokenStore: " << loss_mask.size() << " mask entries for "
      << tokens.size() << " tokens";
  std::shared_ptr<TokenStore> store(new TokenStore());
  store->size_ = static_cast<int64_t>(tokens.size());
  for (int32_t token : tokens) {
    store->max_token_ = std::max(store->max_token_, token);
  }
  store->memory_ = std::move(tokens);
  store->loss_mask_ = std::move(loss_mask);
  return store;
}

int64_t TokenStore::CountLossTargets(int64_t begin, int64_t count) const {
  CHECK(begin >= 0 && count >= 0 && begin + count <= size_)
      << "TokenStore::CountLossTargets [" << begin << ", " << begin + count
      << ") outside [0, " << size_ << ")";
  if (loss_mask_.empty()) return count;
  int64_t n = 0;
  for (int64_t i = begin; i < begin + count; ++i) n += loss_mask_[i] != 0;
  return n;
}

std::shared_ptr<const TokenStore> TokenStore::FromFile(
    std::unique_ptr<TokenFile> file) {
  std::shared_ptr<TokenStore> store(new TokenStore());
  store->size_ = static_cast<int64_t>(file->tokens().size());
  for (uint16_t token : file->tokens()) {
    store->max_token_ = std::max<int32_t>(store->max_token_, token);
  }
  store->file_ = std::move(file);
  return store;
}

void TokenStore::Read(int64_t begin, int64_t count, int32_t* out) const {
  CHECK(begin >= 0 && count >= 0 && begin + count <= size_)
      << "TokenStore::Read [" << begin << ", " << begin + count
      << ") outside [0, " << size_ << ")";
  if (file_ != nullptr) {
    const uint16_t* tokens = file_->tokens().data() + begin;
    for (int64_t i = 0; i < count; ++i) out[i] = tokens[i];
  } else {
    std::copy_n(memory_.data() + begin, count, out);
  }
}

}  // namespace trainer
}  // namespace fsdpp
