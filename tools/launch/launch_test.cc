// Tests of tools/launch: end-to-end runs of the real `launch` binary (a data
// dependency, found at tools/launch/launch relative to the runfiles working
// directory).
//
// The test process makes itself a child subreaper, so any process the
// launcher leaves behind is reparented here when the launcher exits; "no
// process left" is then checked exactly as "waitpid(-1) reports ECHILD".
// Children write their pids to files in a per-test temporary directory so
// the tests can also check those pids are gone and, if a test fails, kill
// them rather than leak them.
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
#include "core/parallel.h"
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
// End-to-end runs of the launcher binary.

constexpr char kLauncher[] = "tools/launch/launch";

// Exit code reported for a launcher that did not exit by itself in time.
constexpr int kTimedOut = -1000;

struct Result {
  int exit_code = kTimedOut;  // 1000 + signo if the launcher was killed.
  std::string out;
  std::string err;
  double seconds = 0;  // Launcher start to exit.
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::vector<std::string> SortedLines(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  // Every line the launcher writes ends in '\n': the last piece is empty.
  EXPECT_TRUE(!lines.empty() && lines.back().empty()) << text;
  lines.pop_back();
  std::sort(lines.begin(), lines.end());
  return lines;
}

bool ProcessGone(pid_t pid) { return kill(pid, 0) == -1 && errno == ESRCH; }

void SleepMs(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

class LaunchEndToEndTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0) << strerror(errno);
    ASSERT_EQ(access(kLauncher, X_OK), 0) << kLauncher << " not found";
    const char* tmp = getenv("TEST_TMPDIR");
    std::string pattern =
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/launch_XXXXXX");
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << strerror(errno);
    dir_ = pattern;
  }

  void TearDown() override {
    // Never leak processes, even from a failing test.
    if (launcher_pid_ > 0) {
      kill(launcher_pid_, SIGKILL);
      waitpid(launcher_pid_, nullptr, 0);
    }
    for (pid_t pid : PidsFromFiles()) {
      if (!ProcessGone(pid)) kill(pid, SIGKILL);
    }
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(3);
    while (Clock::now() < deadline) {
      const pid_t pid = waitpid(-1, nullptr, WNOHANG);
      if (pid < 0) break;
      if (pid == 0) SleepMs(10);
    }
  }

  // Starts the launcher with `args`; its environment is ours without
  // OMP_NUM_THREADS, plus `extra_env`. Its stdout/stderr go to files. A
  // positive `max_fds` lowers its RLIMIT_NOFILE.
  void Start(const std::vector<std::string>& args,
             const std::vector<std::string>& extra_env = {}, int max_fds = 0) {
    std::vector<std::string> argv_storage = {kLauncher};
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<std::string> env_storage;
    for (char** e = environ; *e != nullptr; ++e) {
      if (!absl::StartsWith(*e, "OMP_NUM_THREADS=")) env_storage.push_back(*e);
    }
    env_storage.insert(env_storage.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> argv, envp;
    for (std::string& s : argv_storage) argv.push_back(s.data());
    argv.push_back(nullptr);
    for (std::string& s : env_storage) envp.push_back(s.data());
    envp.push_back(nullptr);
    const int out_fd = open((dir_ + "/launcher.out").c_str(),
                            O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int err_fd = open((dir_ + "/launcher.err").c_str(),
                            O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ASSERT_GE(out_fd, 0);
    ASSERT_GE(err_fd, 0);
    start_ = Clock::now();
    launcher_pid_ = fork();
    ASSERT_GE(launcher_pid_, 0) << strerror(errno);
    if (launcher_pid_ == 0) {
      dup2(out_fd, STDOUT_FILENO);
      dup2(err_fd, STDERR_FILENO);
      if (max_fds > 0) {
        const rlimit limit = {static_cast<rlim_t>(max_fds),
                              static_cast<rlim_t>(max_fds)};
        if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(125);
      }
      execve(argv[0], argv.data(), envp.data());
      _exit(126);
    }
    close(out_fd);
    close(err_fd);
  }

  // Waits up to `timeout_s` for the launcher to exit (then kills it).
  Result Wait(double timeout_s = 20) {
    Result result;
    const auto deadline =
        start_ + std::chrono::duration_cast<Clock::duration>(
                     std::chrono::duration<double>(timeout_s));
    int status = 0;
    while (true) {
      const pid_t pid = waitpid(launcher_pid_, &status, WNOHANG);
      if (pid == launcher_pid_) {
        result.exit_code =
            WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
        break;
      }
      if (Clock::now() >= deadline) {
        ADD_FAILURE() << "launcher still running after " << timeout_s << "s";
        kill(launcher_pid_, SIGKILL);
        waitpid(launcher_pid_, nullptr, 0);
        break;
      }
      SleepMs(5);
    }
    launcher_pid_ = -1;
    result.seconds =
        std::chrono::duration<double>(Clock::now() - start_).count();
    result.out = ReadFile(dir_ + "/launcher.out");
    result.err = ReadFile(dir_ + "/launcher.err");
    return result;
  }

  Result Run(const std::vector<std::string>& args,
             const std::vector<std::string>& extra_env = {}) {
    Start(args, extra_env);
    return Wait();
  }

  // Shell code that writes the shell's pid to dir_/name atomically.
  std::string WritePid(const std::string& name) const {
    return absl::StrCat("echo $$ > \"", dir_, "/", name, ".tmp\" && mv \"",
                        dir_, "/", name, ".tmp\" \"", dir_, "/", name, "\"");
  }

  // Shell code that waits (up to 10 s, else exits 9) for files in dir_.
  std::string WaitForFiles(const std::vector<std::string>& names) const {
    std::vector<std::string> missing;
    for (const std::string& name : names) {
      missing.push_back(absl::StrCat("[ ! -f \"", dir_, "/", name, "\" ]"));
    }
    return absl::StrCat("i=0; while ", absl::StrJoin(missing, " || "),
                        "; do i=$((i+1)); if [ $i -gt 200 ]; then exit 9; "
                        "fi; sleep 0.05; done");
  }

  // Waits up to 10 s for dir_/name and returns the pid in it (or -1).
  pid_t WaitForPid(const std::string& name) const {
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < deadline) {
      pid_t pid = -1;
      if (absl::SimpleAtoi(ReadFile(dir_ + "/" + name), &pid)) return pid;
      SleepMs(10);
    }
    ADD_FAILURE() << "no pid file " << name;
    return -1;
  }

  // The pids the children wrote, from every file named pid* in dir_.
  std::vector<pid_t> PidsFromFiles() const {
    std::vector<pid_t> pids;
    DIR* dir = opendir(dir_.c_str());
    if (dir == nullptr) return pids;
    while (const dirent* entry = readdir(dir)) {
      const std::string name = entry->d_name;
      pid_t pid = -1;
      if (absl::StartsWith(name, "pid") && !absl::EndsWith(name, ".tmp") &&
          absl::SimpleAtoi(ReadFile(dir_ + "/" + name), &pid) && pid > 0) {
        pids.push_back(pid);
      }
    }
    closedir(dir);
    return pids;
  }

  // Checks that the (exited) launcher left no process behind: its orphans
  // would be our children now, so we must have none once zombies are reaped.
  void ExpectNoProcessLeft() {
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(2);
    while (true) {
      const pid_t pid = waitpid(-1, nullptr, WNOHANG);
      if (pid < 0 && errno == ECHILD) break;
      if (Clock::now() >= deadline) {
        ADD_FAILURE() << "the launcher left processes behind";
        break;
      }
      if (pid == 0) SleepMs(10);
    }
    for (pid_t pid : PidsFromFiles()) {
      EXPECT_TRUE(ProcessGone(pid)) << "pid " << pid << " is still alive";
    }
  }

  std::string dir_;
  pid_t launcher_pid_ = -1;
  Clock::time_point start_;
};

TEST_F(LaunchEndToEndTest, ThreeRanksGetTheirEnvironmentAndPrefixedOutput) {
  const Result r =
      Run({"--nproc_per_node=3", "--nnodes=2", "--node_rank=1",
           "--master_addr=10.0.0.7", "--master_port=12345", "/bin/sh", "-c",
           "echo \"rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK "
           "lws=$LOCAL_WORLD_SIZE group=$GROUP_RANK addr=$MASTER_ADDR "
           "port=$MASTER_PORT omp=$OMP_NUM_THREADS extra=$LAUNCH_TEST_VAR\"; "
           "echo \"to stderr $RANK\" >&2; printf \"unterminated $RANK\""},
          {"LAUNCH_TEST_VAR=passed", "RANK=99"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const int omp = std::max(1, AvailableCpus() / 3);
  std::vector<std::string> out, err;
  for (int rank = 3; rank < 6; ++rank) {
    out.push_back(absl::StrCat(
        "[rank ", rank, "] rank=", rank, " world=6 local=", rank - 3,
        " lws=3 group=1 addr=10.0.0.7 port=12345 omp=", omp, " extra=passed"));
    out.push_back(absl::StrCat("[rank ", rank, "] unterminated ", rank));
    err.push_back(absl::StrCat("[rank ", rank, "] to stderr ", rank));
  }
  std::sort(out.begin(), out.end());
  std::sort(err.begin(), err.end());
  EXPECT_EQ(SortedLines(r.out), out) << r.out;
  EXPECT_EQ(SortedLines(r.err), err) << r.err;
  ExpectNoProcessLeft();
}

TEST_F(LaunchEndToEndTest, KeepsOmpNumThreadsAndFindsProgramInPath) {
  const Result r = Run({"--nproc_per_node=2", "--", "sh", "-c",
                        "echo omp=$OMP_NUM_THREADS \"$0\"", "--nnodes=5"},
                       {"OMP_NUM_THREADS=7"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(SortedLines(r.out), ElementsAre("[rank 0] omp=7 --nnodes=5",
                                              "[rank 1] omp=7 --nnodes=5"));
}

TEST_F(LaunchEndToEndTest, LongConcurrentOutputStaysLineAligned) {
  constexpr int kLines = 300;
  const Result r =
      Run({"--nproc_per_node=3", "/bin/sh", "-c",
           absl::StrCat("x=$(head -c 3000 /dev/zero | tr '\\0' x); i=0; "
                        "while [ $i -lt ",
                        kLines,
                        " ]; do echo \"$RANK $i $x\"; echo \"e$RANK $i\" >&2; "
                        "i=$((i+1)); done")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string xs(3000, 'x');
  std::vector<int> next(3, 0);
  for (absl::string_view line :
       absl::StrSplit(r.out, '\n', absl::SkipEmpty())) {
    bool matched = false;
    for (int rank = 0; rank < 3; ++rank) {
      if (line ==
          absl::StrCat("[rank ", rank, "] ", rank, " ", next[rank], " ", xs)) {
        ++next[rank];
        matched = true;
        break;
      }
    }
    ASSERT_TRUE(matched) << "unexpected line: " << line.substr(0, 60);
  }
  EXPECT_THAT(next, ElementsAre(kLines, kLines, kLines));
  EXPECT_EQ(SortedLines(r.err).size(), 3u * kLines);
}

// The acceptance case: rank 1 fails while ranks 0 and 2 sleep.
TEST_F(LaunchEndToEndTest, FailingRankStopsTheOthersAndSetsExitStatus) {
  const Result r = Run(
      {"--nproc_per_node=3", "--grace_period_s=15", "/bin/sh", "-c",
       absl::StrCat("if [ $RANK = 1 ]; then ", WaitForFiles({"pid0", "pid2"}),
                    "; echo failing; exit 3; fi; ", WritePid("pid$RANK"),
                    "; exec sleep 60")});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  // Well under the grace period: the sleepers died of SIGTERM.
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_THAT(r.err, HasSubstr("launch: rank 1 exited with status 3\n"));
  EXPECT_THAT(r.err, Not(HasSubstr("rank 0 exited")));
  EXPECT_THAT(r.err, Not(HasSubstr("SIGKILL")));
  EXPECT_EQ(r.out, "[rank 1] failing\n");
  ASSERT_EQ(PidsFromFiles().size(), 2u);
  ExpectNoProcessLeft();
}

TEST_F(LaunchEndToEndTest, RankKilledBySignal) {
  const Result r =
      Run({"--nproc_per_node=3", "--grace_period_s=15", "/bin/sh", "-c",
           absl::StrCat("if [ $RANK = 1 ]; then ",
                        WaitForFiles({"pid0", "pid2"}), "; kill -9 $$; fi; ",
                        WritePid("pid$RANK"), "; exec sleep 60")});
  EXPECT_EQ(r.exit_code, 137) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_THAT(r.err,
              HasSubstr("launch: rank 1 was killed by signal SIGKILL\n"));
  ASSERT_EQ(PidsFromFiles().size(), 2u);
  ExpectNoProcessLeft();
}

// Restarts: every attempt sees the same job identity and its attempt
// number (what a trainer resumes by); when none is left, the launcher says
// so last.
TEST_F(LaunchEndToEndTest, RestartsKeepTheJobAndCountTheRoundsUntilNoneLeft) {
  const Result r =
      Run({"--nproc_per_node=1", "--max_restarts=2", "/bin/sh", "-c",
           "echo \"job $FSDPP_JOB_ID round $FSDPP_LAUNCH_ROUND restart "
           "$TORCHELASTIC_RESTART_COUNT\"; exit 4"});
  EXPECT_EQ(r.exit_code, 4) << r.err;
  const std::vector<std::string> lines =
      absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << r.out;
  const std::string job = lines[0].substr(0, lines[0].find(" round"));
  EXPECT_GT(job.size(), std::string("[rank 0] job ").size()) << r.out;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(lines[i], absl::StrCat(job, " round ", i, " restart ", i));
  }
  EXPECT_THAT(r.err, HasSubstr("launch: restarting the local ranks (restart 2 "
                               "of 2)\n"));
  EXPECT_TRUE(absl::EndsWith(
      r.err, "launch: no restarts left (--max_restarts=2): the job failed\n"))
      << r.err;
  // A job identity given to the launcher is the job's.
  const Result given =
      Run({"--nproc_per_node=1", "/bin/sh", "-c", "echo $FSDPP_JOB_ID"},
          {"FSDPP_JOB_ID=slurm-42"});
  EXPECT_EQ(given.out, "[rank 0] slurm-42\n") << given.err;
}

// A program of its own started as launched ranks (mesh/ranks.h
// RunAsLaunchedRank): the world from the launcher's environment, a mesh over
// it, a collective across the processes.
TEST_F(LaunchEndToEndTest, LaunchedRanksBuildTheirMeshFromTheEnvironment) {
  const Result r =
      Run({"--nproc_per_node=3",
           absl::StrCat("--master_port=", 20000 + getpid() % 20000),
           "tools/launch/ranks_demo"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(SortedLines(r.out),
            (std::vector<std::string>{"[rank 0] rank 0 of 3: sum 6",
                                      "[rank 1] rank 1 of 3: sum 6",
                                      "[rank 2] rank 2 of 3: sum 6"}))
      << r.out << r.err;
}

TEST_F(LaunchEndToEndTest, RankIgnoringSigtermIsKilledAfterGracePeriod) {
  const Result r =
      Run({"--nproc_per_node=2", "--grace_period_s=1", "/bin/sh", "-c",
           absl::StrCat("if [ $RANK = 0 ]; then ", WaitForFiles({"pid1"}),
                        "; exit 4; fi; trap '' TERM; ", WritePid("pid1"),
                        "; exec sleep 60")});
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_GE(r.seconds, 1.0);  // The grace period was honoured...
  EXPECT_LT(r.seconds, 6.0);  // ...and then SIGKILL ended it.
  EXPECT_THAT(r.err, HasSubstr("launch: rank 0 exited with status 4\n"));
  EXPECT_THAT(r.err, HasSubstr("rank 1 still running after 1s grace period; "
                               "sending SIGKILL"));
  ASSERT_EQ(PidsFromFiles().size(), 1u);
  ExpectNoProcessLeft();
}

TEST_F(LaunchEndToEndTest, ProcessesLeftBySuccessfulRanksAreStopped) {
  const Result r = Run(
      {"--nproc_per_node=2", "--grace_period_s=15", "/bin/sh", "-c",
       absl::StrCat("sleep 60 & echo $! > \"", dir_, "/bg$RANK\"; mv \"", dir_,
                    "/bg$RANK\" \"", dir_, "/pid_bg$RANK\"; echo done")});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_THAT(SortedLines(r.out),
              ElementsAre("[rank 0] done", "[rank 1] done"));
  EXPECT_THAT(r.err, HasSubstr("stopping the processes they left running"));
  ASSERT_EQ(PidsFromFiles().size(), 2u);
  ExpectNoProcessLeft();
}

class LauncherSignalTest : public LaunchEndToEndTest,
                           public ::testing::WithParamInterface<int> {};

TEST_P(LauncherSignalTest, StopsAllRanks) {
  const int signo = GetParam();
  // Each rank runs a background sleeper and reports SIGTERM on stdout.
  Start({"--nproc_per_node=2", "--grace_period_s=15", "/bin/sh", "-c",
         absl::StrCat("trap 'echo got SIGTERM; exit 0' TERM; sleep 60 & ",
                      "echo $! > \"", dir_, "/bg$RANK\"; mv \"", dir_,
                      "/bg$RANK\" \"", dir_, "/pid_bg$RANK\"; ",
                      WritePid("pid$RANK"), "; wait")});
  for (const char* name : {"pid0", "pid1", "pid_bg0", "pid_bg1"}) {
    ASSERT_GT(WaitForPid(name), 0);
  }
  const Clock::time_point signalled = Clock::now();
  ASSERT_EQ(kill(launcher_pid_, signo), 0);
  const Result r = Wait();
  EXPECT_EQ(r.exit_code, 128 + signo) << r.err;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - signalled).count(),
            5.0);
  EXPECT_THAT(r.err,
              HasSubstr(absl::StrCat("launch: received ", SignalName(signo),
                                     "; stopping all ranks")));
  EXPECT_THAT(SortedLines(r.out),
              ElementsAre("[rank 0] got SIGTERM", "[rank 1] got SIGTERM"));
  ExpectNoProcessLeft();
}

INSTANTIATE_TEST_SUITE_P(SigintAndSigterm, LauncherSignalTest,
                         ::testing::Values(SIGINT, SIGTERM),
                         [](const auto& info) {
                           return SignalName(info.param);
                         });

TEST_F(LaunchEndToEndTest, SecondSigintSkipsTheGracePeriod) {
  Start({"--nproc_per_node=2", "--grace_period_s=15", "/bin/sh", "-c",
         absl::StrCat("trap '' TERM; ", WritePid("pid$RANK"),
                      "; exec sleep 60")});
  ASSERT_GT(WaitForPid("pid0"), 0);
  ASSERT_GT(WaitForPid("pid1"), 0);
  const Clock::time_point signalled = Clock::now();
  ASSERT_EQ(kill(launcher_pid_, SIGINT), 0);
  // Wait for the first SIGINT to be handled before sending the second.
  const std::string err_path = dir_ + "/launcher.err";
  while (!absl::StrContains(ReadFile(err_path), "stopping all ranks")) {
    ASSERT_LT(Clock::now() - signalled, std::chrono::seconds(10));
    SleepMs(10);
  }
  ASSERT_EQ(kill(launcher_pid_, SIGINT), 0);
  const Result r = Wait();
  EXPECT_EQ(r.exit_code, 130) << r.err;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - signalled).count(),
            5.0);
  EXPECT_THAT(r.err, HasSubstr("received SIGINT again; killing all ranks"));
  ExpectNoProcessLeft();
}

TEST_F(LaunchEndToEndTest, RanksDieWithAKilledLauncher) {
  Start({"--nproc_per_node=2", "/bin/sh", "-c",
         absl::StrCat(WritePid("pid$RANK"), "; exec sleep 60")});
  ASSERT_GT(WaitForPid("pid0"), 0);
  ASSERT_GT(WaitForPid("pid1"), 0);
  ASSERT_EQ(kill(launcher_pid_, SIGKILL), 0);
  const Result r = Wait();
  EXPECT_EQ(r.exit_code, 1000 + SIGKILL);
  ExpectNoProcessLeft();
}

TEST_F(LaunchEndToEndTest, RankThatCannotStartStopsTheOthers) {
  // Each rank needs two pipes: with 24 descriptors, 40 ranks cannot start.
  Start({"--nproc_per_node=40", "--grace_period_s=15", "/bin/sh", "-c",
         absl::StrCat(WritePid("pid$RANK"), "; exec sleep 60")},
        {}, /*max_fds=*/24);
  const Result r = Wait();
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_THAT(r.err, HasSubstr("launch: cannot start rank "));
  EXPECT_THAT(r.err, HasSubstr("Too many open files"));
  ExpectNoProcessLeft();
}

TEST_F(LaunchEndToEndTest, BadFlagsExit2WithUsage) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--nnodes=2", "--node_rank=2", "/bin/true"}, "--node_rank=2"},
      {{"--master_port=70000", "/bin/true"}, "--master_port=70000"},
      {{"--nproc_per_node=2"}, "missing PROGRAM"},
      {{"--no_such_flag", "/bin/true"}, "unknown flag --no_such_flag"},
  };
  for (const auto& [args, error] : cases) {
    const Result r = Run(args);
    EXPECT_EQ(r.exit_code, 2) << absl::StrJoin(args, " ");
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat("launch: ", error)));
    EXPECT_THAT(r.err, HasSubstr("Usage: launch"));
    EXPECT_EQ(r.out, "");
  }
}

TEST_F(LaunchEndToEndTest, HelpExits0) {
  const Result r = Run({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("Usage: launch"));
}

TEST_F(LaunchEndToEndTest, MissingProgramExits127) {
  const Result r = Run({"--nproc_per_node=2", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, 127) << r.err;
  EXPECT_THAT(r.err,
              HasSubstr("launch: cannot execute '/nonexistent/program'"));
  EXPECT_THAT(r.err, HasSubstr("exited with status 127"));
  ExpectNoProcessLeft();
}

}  // namespace
}  // namespace launch
}  // namespace fsdpp
