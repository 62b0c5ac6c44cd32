// Unit tests of the launcher library: argument parsing, the rank
// environment, signal names and the output line prefixer. The launcher
// binary's end-to-end runs are in tools/launch/launch_test.cc.
#include "runtime/launch.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace fsdpp {
namespace launch {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// ParseLaunchArgs

// OomKillCount over fake /proc and /sys/fs/cgroup trees: the memory
// cgroup's own count (v1, then v2), else the machine's, else -1.
TEST(OomKillCountTest, CgroupV1ThenV2ThenVmstat) {
  const std::string root = absl::StrCat(std::getenv("TEST_TMPDIR"), "/oom");
  const auto write = [&](const std::string& path, const std::string& text) {
    const std::string full = root + path;
    std::system(absl::StrCat("mkdir -p '", full.substr(0, full.rfind('/')), "'")
                    .c_str());
    std::ofstream(full) << text;
  };
  const std::string proc = root + "/proc", cg = root + "/cg";
  EXPECT_EQ(OomKillCount(proc, cg), -1);  // nothing readable
  write("/proc/vmstat", "pgfault 12\noom_kill 7\n");
  EXPECT_EQ(OomKillCount(proc, cg), 7);
  write("/proc/self/cgroup", "4:memory:/job/a\n0::/job/b\n");
  write("/cg/unified/job/b/memory.events", "low 0\noom 3\noom_kill 2\n");
  EXPECT_EQ(OomKillCount(proc, cg), 2);  // v2 (no v1 file yet)
  write("/cg/memory/job/a/memory.oom_control",
        "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n");
  EXPECT_EQ(OomKillCount(proc, cg), 5);  // v1 first
}

TEST(ParseLaunchArgsTest, Defaults) {
  auto options = ParseLaunchArgs({"prog"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->nproc_per_node, 1);
  EXPECT_EQ(options->nnodes, 1);
  EXPECT_EQ(options->node_rank, 0);
  EXPECT_EQ(options->master_addr, "127.0.0.1");
  EXPECT_EQ(options->master_port, 29500);
  EXPECT_EQ(options->grace_period_s, 5.0);
  EXPECT_FALSE(options->help);
  EXPECT_THAT(options->program, ElementsAre("prog"));
}

TEST(ParseLaunchArgsTest, AllFlags) {
  auto options =
      ParseLaunchArgs({"--nproc_per_node=4", "--nnodes=3", "--node_rank=2",
                       "--master_addr=node0", "--master_port=1234",
                       "--grace_period_s=0.5", "prog", "-x", "--nnodes=9"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->nproc_per_node, 4);
  EXPECT_EQ(options->nnodes, 3);
  EXPECT_EQ(options->node_rank, 2);
  EXPECT_EQ(options->master_addr, "node0");
  EXPECT_EQ(options->master_port, 1234);
  EXPECT_EQ(options->grace_period_s, 0.5);
  // Everything from the program on is the program's, flag-like or not.
  EXPECT_THAT(options->program, ElementsAre("prog", "-x", "--nnodes=9"));
}

TEST(ParseLaunchArgsTest, SeparateValuesSingleDashAndDoubleDash) {
  auto options = ParseLaunchArgs(
      {"--nproc_per_node", "2", "-master_port=7", "--", "--prog", "a"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->nproc_per_node, 2);
  EXPECT_EQ(options->master_port, 7);
  EXPECT_THAT(options->program, ElementsAre("--prog", "a"));
}

TEST(ParseLaunchArgsTest, ElasticNodes) {
  auto options = ParseLaunchArgs({"--nnodes=1:3", "--node_rank=2",
                                  "--rdzv_last_call_s=2.5",
                                  "--rdzv_timeout_s=60", "prog"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_TRUE(options->elastic());
  EXPECT_EQ(options->min_nodes, 1);
  EXPECT_EQ(options->max_nodes, 3);
  EXPECT_EQ(options->nnodes, 3);
  EXPECT_EQ(options->node_rank, 2);
  EXPECT_EQ(options->rdzv_last_call_s, 2.5);
  EXPECT_EQ(options->rdzv_timeout_s, 60);

  // A plain count after MIN:MAX makes the job static again.
  options = ParseLaunchArgs({"--nnodes=1:3", "--nnodes=2", "prog"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_FALSE(options->elastic());
  EXPECT_EQ(options->nnodes, 2);
}

TEST(ParseLaunchArgsTest, Help) {
  auto options = ParseLaunchArgs({"--help"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_TRUE(options->help);
  EXPECT_THAT(LaunchUsage(), HasSubstr("--nproc_per_node"));
}

TEST(ParseLaunchArgsTest, RejectsBadArguments) {
  struct Case {
    std::vector<std::string> args;
    std::string error;
  };
  const Case cases[] = {
      {{}, "missing PROGRAM"},
      {{"--nproc_per_node=2"}, "missing PROGRAM"},
      {{"--"}, "missing PROGRAM"},
      {{"--node_rank=2", "--nnodes=2", "p"}, "--node_rank=2"},
      {{"--node_rank=-1", "p"}, "--node_rank=-1"},
      {{"--master_port=70000", "p"}, "--master_port=70000"},
      {{"--master_port=0", "p"}, "--master_port=0"},
      {{"--nproc_per_node=0", "p"}, "--nproc_per_node=0"},
      {{"--nproc_per_node=two", "p"}, "not an integer"},
      {{"--nnodes=0", "p"}, "--nnodes=0"},
      {{"--nnodes=65536", "--nproc_per_node=65536", "p"}, "fit"},
      {{"--grace_period_s=-1", "p"}, "--grace_period_s"},
      {{"--grace_period_s=nan", "p"}, "--grace_period_s"},
      {{"--grace_period_s=soon", "p"}, "not a number"},
      {{"--master_addr=", "p"}, "--master_addr"},
      {{"--bogus=1", "p"}, "unknown flag --bogus=1"},
      {{"--verbose", "p"}, "unknown flag --verbose"},
      {{"--nnodes"}, "needs a value"},
      {{"--nnodes=2:1", "p"}, "need 1 <= MIN <= MAX"},
      {{"--nnodes=0:2", "p"}, "need 1 <= MIN <= MAX"},
      {{"--nnodes=1:x", "p"}, "is not N or MIN:MAX"},
      {{"--nnodes=1:2", "--node_rank=2", "p"}, "--node_rank=2"},
      {{"--nnodes=1:2", "--master_port=65535", "p"}, "port + 1"},
      {{"--rdzv_last_call_s=-1", "p"}, "--rdzv_last_call_s=-1"},
      {{"--rdzv_timeout_s=inf", "p"}, "--rdzv_timeout_s=inf"},
  };
  for (const Case& c : cases) {
    auto options = ParseLaunchArgs(c.args);
    EXPECT_FALSE(options.ok()) << absl::StrJoin(c.args, " ");
    EXPECT_THAT(std::string(options.status().message()), HasSubstr(c.error))
        << absl::StrJoin(c.args, " ");
  }
}

// ---------------------------------------------------------------------------
// RankEnvironment, SignalName, LinePrefixer

std::string EnvValue(const std::vector<std::string>& env,
                     const std::string& key) {
  std::string value = "<unset>";
  int count = 0;
  for (const std::string& entry : env) {
    if (absl::StartsWith(entry, key + "=")) {
      value = entry.substr(key.size() + 1);
      ++count;
    }
  }
  return count > 1 ? "<duplicate>" : value;
}

TEST(RankEnvironmentTest, SetsRendezvousVariables) {
  LaunchOptions options;
  options.nproc_per_node = 3;
  options.nnodes = 2;
  options.node_rank = 1;
  options.master_addr = "10.0.0.1";
  options.master_port = 1234;
  const std::vector<std::string> env = RankEnvironment(
      options, 2, {"PATH=/bin", "RANK=99", "MASTER_PORT=1"}, /*num_cpus=*/16);
  EXPECT_EQ(EnvValue(env, "PATH"), "/bin");
  EXPECT_EQ(EnvValue(env, "RANK"), "5");
  EXPECT_EQ(EnvValue(env, "WORLD_SIZE"), "6");
  EXPECT_EQ(EnvValue(env, "LOCAL_RANK"), "2");
  EXPECT_EQ(EnvValue(env, "LOCAL_WORLD_SIZE"), "3");
  EXPECT_EQ(EnvValue(env, "GROUP_RANK"), "1");
  EXPECT_EQ(EnvValue(env, "MASTER_ADDR"), "10.0.0.1");
  EXPECT_EQ(EnvValue(env, "MASTER_PORT"), "1234");
  EXPECT_EQ(EnvValue(env, "OMP_NUM_THREADS"), "5");  // 16 / 3.
}

TEST(RankEnvironmentTest, OmpNumThreads) {
  LaunchOptions options;
  options.nproc_per_node = 8;
  EXPECT_EQ(EnvValue(RankEnvironment(options, 0, {}, 2), "OMP_NUM_THREADS"),
            "1");
  EXPECT_EQ(EnvValue(RankEnvironment(options, 0, {"OMP_NUM_THREADS=3"}, 64),
                     "OMP_NUM_THREADS"),
            "3");
}

TEST(SignalNameTest, NamesSignals) {
  EXPECT_EQ(SignalName(SIGKILL), "SIGKILL");
  EXPECT_EQ(SignalName(SIGTERM), "SIGTERM");
  EXPECT_EQ(SignalName(1000), "signal 1000");
}

TEST(LinePrefixerTest, PrefixesWholeLines) {
  LinePrefixer prefixer("[rank 2] ");
  EXPECT_EQ(prefixer.Append("a\nb"), "[rank 2] a\n");
  EXPECT_EQ(prefixer.Append("c"), "");
  EXPECT_EQ(prefixer.Append("d\n\ne"), "[rank 2] bcd\n[rank 2] \n");
  EXPECT_EQ(prefixer.Finish(), "[rank 2] e\n");
  EXPECT_EQ(prefixer.Finish(), "");
}

TEST(LinePrefixerTest, StatusLinesOnATerminalAreDrawnInPlace) {
  TerminalState terminal;
  LinePrefixer out("[rank 0] ", LinePrefixer::kDefaultMaxLineBytes, &terminal);
  LinePrefixer err("[rank 1] ", LinePrefixer::kDefaultMaxLineBytes, &terminal);
  EXPECT_EQ(out.Append("\rstep 1/9\n"), "\r[rank 0] step 1/9\033[K");
  EXPECT_TRUE(terminal.status_shown);
  // The next status replaces it in place.
  EXPECT_EQ(out.Append("\rstep 2/9\n"), "\r[rank 0] step 2/9\033[K");
  // An ordinary line (from any prefixer on the terminal) erases it first.
  EXPECT_EQ(err.Append("warning\n"), "\r\033[K[rank 1] warning\n");
  EXPECT_FALSE(terminal.status_shown);
  EXPECT_EQ(out.Append("plain\n"), "[rank 0] plain\n");
  // At the end the last status is kept and its line ended.
  EXPECT_EQ(out.Append("\rstep 9/9\n"), "\r[rank 0] step 9/9\033[K");
  EXPECT_EQ(out.Finish(), "\n");
  EXPECT_EQ(err.Finish(), "");
}

TEST(LinePrefixerTest, StatusLinesElsewhereAreOrdinaryLines) {
  LinePrefixer prefixer("[rank 0] ");
  EXPECT_EQ(prefixer.Append("\rstep 1/9\nnext\n"),
            "[rank 0] step 1/9\n[rank 0] next\n");
}

TEST(LinePrefixerTest, CutsOverlongLines) {
  LinePrefixer prefixer("> ", /*max_line_bytes=*/4);
  EXPECT_EQ(prefixer.Append("abcdefghij"), "> abcd\n> efgh\n");
  EXPECT_EQ(prefixer.Append("\n"), "> ij\n");
  EXPECT_EQ(prefixer.Finish(), "");
}

}  // namespace
}  // namespace launch
}  // namespace fsdpp
