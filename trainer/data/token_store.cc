// TokenStore over an int32 vector or a uint16 mapped shard.
#include "trainer/data/token_store.h"

#include <algorithm>
#include <utility>

#include "core/logging.h"

namespace fsdpp {
namespace trainer {

std::shared_ptr<const TokenStore> TokenStore::FromVector(
    std::vector<int32_t> tokens) {
  std::shared_ptr<TokenStore> store(new TokenStore());
  store->size_ = static_cast<int64_t>(tokens.size());
  for (int32_t token : tokens) {
    store->max_token_ = std::max(store->max_token_, token);
  }
  store->memory_ = std::move(tokens);
  return store;
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
