#include "core/cli.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

ABSL_FLAG(int, cli_test_count, 3, "how many things");
ABSL_FLAG(bool, cli_test_verbose, false, "say more");
ABSL_FLAG(std::string, cli_test_name, "", "a name");
ABSL_FLAG(std::vector<std::string>, cli_test_set, {}, "overrides (repeatable)");

namespace fsdpp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::StatusOr<CommandLine> Parse(std::vector<const char*> args,
                                  std::vector<std::string> repeatable = {}) {
  args.insert(args.begin(), "prog");
  return ParseCommandLineFlags(static_cast<int>(args.size()), args.data(),
                               repeatable);
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::SetFlag(&FLAGS_cli_test_count, 3);
    absl::SetFlag(&FLAGS_cli_test_verbose, false);
    absl::SetFlag(&FLAGS_cli_test_name, "");
  }
};

TEST_F(CliTest, EveryValueFormAndPositionals) {
  absl::StatusOr<CommandLine> line =
      Parse({"a", "--cli_test_count=7", "b", "--cli_test_name", "x y",
             "-cli_test_verbose", "--", "--cli_test_count=9", "c"});
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_count), 7);
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_name), "x y");
  EXPECT_TRUE(absl::GetFlag(FLAGS_cli_test_verbose));
  EXPECT_THAT(line->positional,
              ElementsAre("a", "b", "--cli_test_count=9", "c"));
  EXPECT_FALSE(line->help);
}

TEST_F(CliTest, NegatedBoolAndHelp) {
  absl::SetFlag(&FLAGS_cli_test_verbose, true);
  absl::StatusOr<CommandLine> line = Parse({"--nocli_test_verbose", "-h"});
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_FALSE(absl::GetFlag(FLAGS_cli_test_verbose));
  EXPECT_TRUE(line->help);
}

TEST_F(CliTest, RepeatableFlagsCollectEveryValue) {
  absl::StatusOr<CommandLine> line = Parse(
      {"--cli_test_set=a.b=1,2", "--cli_test_set", "c=3"}, {"cli_test_set"});
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_THAT(line->repeated["cli_test_set"], ElementsAre("a.b=1,2", "c=3"));
}

TEST_F(CliTest, UsageErrorsNameTheFlag) {
  absl::StatusOr<CommandLine> line = Parse({"--cli_test_cuont=1"});
  ASSERT_FALSE(line.ok());
  EXPECT_THAT(line.status().message(),
              HasSubstr("unknown flag --cli_test_cuont (flags: "));
  EXPECT_THAT(line.status().message(), HasSubstr("--cli_test_count"));
  // absl's own flags are not the program's.
  EXPECT_FALSE(Parse({"--flagfile=x"}).ok());

  line = Parse({"--cli_test_count=many"});
  ASSERT_FALSE(line.ok());
  EXPECT_THAT(line.status().message(),
              HasSubstr("bad value \"many\" for --cli_test_count"));
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_count), 3);

  line = Parse({"--cli_test_name"});
  ASSERT_FALSE(line.ok());
  EXPECT_EQ(line.status().message(), "--cli_test_name needs a value");

  line = Parse({"--nocli_test_verbose=1"});
  ASSERT_FALSE(line.ok());
  EXPECT_EQ(line.status().message(), "--nocli_test_verbose takes no value");
}

TEST_F(CliTest, HelpListsEveryFlagWithItsDefault) {
  const std::string help = FlagsHelp("usage: prog [flags]\n");
  EXPECT_THAT(help, HasSubstr("usage: prog [flags]\n\nFlags:\n"));
  EXPECT_THAT(help, HasSubstr("--cli_test_count (default: 3)\n      how many"));
  EXPECT_THAT(help, HasSubstr("--cli_test_verbose (default: false)"));
  EXPECT_THAT(help, HasSubstr("--cli_test_name (default: \"\")"));
  EXPECT_THAT(help, HasSubstr("--help\n"));
  EXPECT_THAT(help, ::testing::Not(HasSubstr("--flagfile")));
}

}  // namespace
}  // namespace fsdpp
