// llm.c / nanoGPT token shards (".bin"): a 1024-byte header of 256
// little-endian int32 (magic 20240520, version 1, token count, then zeros)
// followed by the tokens as little-endian uint16.
//
// Reading maps the file (mmap) rather than copying it, so a shard of
// hundreds of millions of tokens costs no heap and ranks on one host share
// the page cache. The header is validated against the file size before any
// token is touched: bad magic, unknown version, negative counts and files
// that are truncated or have trailing bytes are errors. Only little-endian
// hosts are supported (as llm.c).
#ifndef FSDPP_TRAINER_DATA_TOKEN_FILE_H_
#define FSDPP_TRAINER_DATA_TOKEN_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace fsdpp {
namespace trainer {

// The header constants of llm.c's uint16 token shards.
inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;
inline constexpr size_t kTokenFileHeaderBytes = 256 * sizeof(int32_t);

// A read-only, memory-mapped, validated token shard.
class TokenFile {
 public:
  // Maps and validates `path`. NotFound if it does not exist; InvalidArgument
  // "token file "<path>": <problem>" for a bad header or size.
  static absl::StatusOr<std::unique_ptr<TokenFile>> Open(
      const std::string& path);

  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  // The tokens after the header.
  absl::Span<const uint16_t> tokens() const { return tokens_; }
  // The path it was opened from.
  const std::string& path() const { return path_; }

 private:
  TokenFile() = default;

  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  absl::Span<const uint16_t> tokens_;
};

// Writes `tokens` as a version-1 shard at `path` (atomically: temporary file,
// then rename). InvalidArgument naming the first token outside [0, 65535].
absl::Status WriteTokenFile(const std::string& path,
                            absl::Span<const int32_t> tokens);

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_TOKEN_FILE_H_
