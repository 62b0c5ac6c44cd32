// Tests of the llm.c token shard reader/writer: round trips and every
// validation error (exact text).
#include "trainer/data/token_file.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "formats/file_util.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace trainer {
namespace {

std::string TempPath(absl::string_view name) {
  return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
}

// A raw file: header fields, then `tokens` uint16 tokens, then `extra` bytes.
std::string RawShard(int32_t magic, int32_t version, int32_t count,
                     size_t tokens, size_t extra = 0) {
  std::string bytes(kTokenFileHeaderBytes + 2 * tokens + extra, '\0');
  const int32_t header[3] = {magic, version, count};
  std::memcpy(bytes.data(), header, sizeof(header));
  return bytes;
}

TEST(TokenFileTest, RoundTrip) {
  const std::string path = TempPath("round_trip.bin");
  const std::vector<int32_t> tokens = {0, 1, 50256, 65535, 42, 7};
  ASSERT_TRUE(WriteTokenFile(path, tokens).ok());
  auto bytes = ReadFileToString(path);
  ASSERT_TRUE(bytes.ok());
  ASSERT_EQ(bytes->size(), 1024u + 2 * tokens.size());
  // The llm.c header, byte for byte.
  int32_t header[256];
  std::memcpy(header, bytes->data(), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 6);
  for (int i = 3; i < 256; ++i) EXPECT_EQ(header[i], 0);

  auto file = TokenFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  ASSERT_EQ((*file)->tokens().size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ((*file)->tokens()[i], tokens[i]);
  }
}

TEST(TokenFileTest, EmptyShard) {
  const std::string path = TempPath("empty.bin");
  ASSERT_TRUE(WriteTokenFile(path, {}).ok());
  auto file = TokenFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tokens().empty());
}

TEST(TokenFileTest, WriteRejectsTokensBeyondUint16) {
  const std::string path = TempPath("too_big.bin");
  const absl::Status status = WriteTokenFile(path, {1, 65536});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            absl::StrCat("token file \"", path,
                         "\": token 65536 at position 1 does not fit in "
                         "uint16"));
  EXPECT_FALSE(IsRegularFile(path));
  EXPECT_EQ(WriteTokenFile(path, {-3}).message(),
            absl::StrCat("token file \"", path,
                         "\": token -3 at position 0 does not fit in uint16"));
}

TEST(TokenFileTest, OpenErrors) {
  struct Case {
    std::string name;
    std::string bytes;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {"short.bin", std::string(100, '\0'),
       "100 bytes is shorter than the 1024-byte header"},
      {"magic.bin", RawShard(12345, 1, 0, 0),
       "bad magic 12345 (expected 20240520, llm.c's uint16 token shard)"},
      {"version.bin", RawShard(20240520, 2, 0, 0),
       "unsupported version 2 (expected 1)"},
      {"negative.bin", RawShard(20240520, 1, -5, 0), "negative token count -5"},
      {"truncated.bin", RawShard(20240520, 1, 10, 9),
       "the header says 10 tokens (1044 bytes) but the file has 1042 bytes "
       "(truncated)"},
      {"trailing.bin", RawShard(20240520, 1, 10, 10, 1),
       "the header says 10 tokens (1044 bytes) but the file has 1045 bytes "
       "(trailing bytes)"},
  };
  for (const Case& c : cases) {
    const std::string path = TempPath(c.name);
    ASSERT_TRUE(WriteFileAtomically(path, c.bytes).ok());
    auto file = TokenFile::Open(path);
    ASSERT_FALSE(file.ok()) << c.name;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(file.status().message(),
              absl::StrCat("token file \"", path, "\": ", c.problem));
  }
  auto missing = TokenFile::Open(TempPath("missing.bin"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            absl::StrCat("cannot open token file \"", TempPath("missing.bin"),
                         "\": No such file or directory"));
  auto directory = TokenFile::Open(std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(directory.status().message(),
            absl::StrCat("token file \"", std::getenv("TEST_TMPDIR"),
                         "\": not a regular file"));
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
