// Tests of the file helpers: round trip, atomic replacement, error codes and
// messages.
#include "formats/file_util.h"

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

std::string TempPath(absl::string_view name) {
  return absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
}

TEST(FileUtilTest, WriteThenRead) {
  const std::string path = TempPath("a.txt");
  const std::string contents("bytes\0and more", 14);
  ASSERT_TRUE(WriteFileAtomically(path, contents).ok());
  ASSERT_TRUE(WriteFileAtomically(path, contents + "!").ok());  // Replaces.
  auto read = ReadFileToString(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, contents + "!");
  EXPECT_TRUE(IsRegularFile(path));
  EXPECT_FALSE(IsDirectory(path));
  EXPECT_TRUE(IsDirectory(std::getenv("TEST_TMPDIR")));
}

TEST(FileUtilTest, Errors) {
  const std::string missing = TempPath("missing.txt");
  auto read = ReadFileToString(missing, "config file");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(read.status().message(),
            absl::StrCat("cannot read config file \"", missing,
                         "\": No such file or directory"));
  const std::string directory = std::getenv("TEST_TMPDIR");
  EXPECT_EQ(ReadFileToString(directory).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      ReadFileToString(directory).status().message(),
      absl::StrCat("cannot read file \"", directory, "\": not a regular file"));
  const std::string nowhere = TempPath("no/such/dir/x");
  EXPECT_EQ(WriteFileAtomically(nowhere, "x").message(),
            absl::StrCat("cannot write file \"", nowhere,
                         "\": No such file or directory"));
  EXPECT_FALSE(IsRegularFile(missing));
}

}  // namespace
}  // namespace fsdpp
