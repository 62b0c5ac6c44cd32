// The embedded corpus is byte-for-byte the shipped text file.
#include "trainer/data/corpus.h"

#include <string>

#include "absl/strings/match.h"
#include "formats/file_util.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace trainer {
namespace {

TEST(CorpusTest, EmbeddedBytesEqualTheSourceFile) {
  auto file = ReadFileToString("trainer/data/corpus/devils_dictionary.txt");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(EmbeddedCorpus().size(), 383157u);
  EXPECT_TRUE(EmbeddedCorpus() == *file);
  EXPECT_TRUE(absl::StrContains(EmbeddedCorpus(),
                                "A Public Domain Text, Copyright Expired"));
  EXPECT_TRUE(absl::EndsWith(EmbeddedCorpus(), "every two years.\n"));
  EXPECT_TRUE(absl::StrContains(EmbeddedCorpusDescription(), "public domain"));
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
