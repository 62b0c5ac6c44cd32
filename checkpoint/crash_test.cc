// Crash safety, with real processes: crash_writer saves ~48 MiB checkpoints
// in a loop and is killed with SIGKILL, alternately while a data file of the
// next checkpoint is being written and after a pseudo-random delay (which
// also lands in commits and retention deletes). After every kill the newest
// reported checkpoint (or a newer one) is on disk, every `step-N` directory
// loads bitwise with its metadata, and nothing else that looks like a
// checkpoint exists: only `.step-*` leftovers, which the next run removes.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/crash_state.h"
#include "checkpoint/test_checkpoints.h"
#include "formats/file_util.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

constexpr char kWriter[] = "checkpoint/crash_writer";

struct Child {
  pid_t pid = -1;
  int out = -1;  // Its stdout.
  std::string pending;
};

Child Start(const std::string& root) {
  int pipe_fds[2];
  CHECK_EQ(::pipe(pipe_fds), 0);
  const pid_t pid = ::fork();
  CHECK_GE(pid, 0);
  if (pid == 0) {
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    ::execl(kWriter, kWriter, root.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  return Child{pid, pipe_fds[0], ""};
}

// Reads the child's output until `deadline`; returns the steps it reported
// committed.
std::vector<int64_t> ReadCommits(Child* child, absl::Time deadline) {
  std::vector<int64_t> steps;
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) break;
    pollfd p{child->out, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(ms)) <= 0) break;
    char buffer[256];
    const ssize_t n = ::read(child->out, buffer, sizeof(buffer));
    if (n <= 0) break;
    child->pending.append(buffer, n);
    size_t newline;
    while ((newline = child->pending.find('\n')) != std::string::npos) {
      const std::string line = child->pending.substr(0, newline);
      child->pending.erase(0, newline + 1);
      int64_t step;
      if (absl::StartsWith(line, "committed ") &&
          absl::SimpleAtoi(line.substr(10), &step)) {
        steps.push_back(step);
      }
    }
    if (!steps.empty()) break;
  }
  return steps;
}

// True when a temporary checkpoint directory holds a non-empty data file.
bool WritingNow(const std::string& root) {
  absl::StatusOr<std::vector<std::string>> names = ListDir(root);
  if (!names.ok()) return false;
  for (const std::string& name : *names) {
    if (!absl::StartsWith(name, ".step-") || !absl::EndsWith(name, ".tmp")) {
      continue;
    }
    const std::string dir = absl::StrCat(root, "/", name);
    absl::StatusOr<std::vector<std::string>> files = ListDir(dir);
    if (!files.ok()) continue;
    for (const std::string& file : *files) {
      struct stat st;
      if (absl::StartsWith(file, "rank-") &&
          ::stat(absl::StrCat(dir, "/", file).c_str(), &st) == 0 &&
          st.st_size > 0 && !PathExists(absl::StrCat(dir, "/metadata.pb"))) {
        return true;
      }
    }
  }
  return false;
}

// Every step-N directory loads bitwise; nothing else looks like one.
void CheckRoot(const std::string& root) {
  absl::StatusOr<std::vector<std::string>> names = ListDir(root);
  ASSERT_TRUE(names.ok()) << names.status();
  for (const std::string& name : *names) {
    if (absl::StartsWith(name, ".step-")) continue;  // Leftovers.
    int64_t step;
    ASSERT_TRUE(absl::StartsWith(name, "step-") &&
                absl::SimpleAtoi(name.substr(5), &step))
        << "unexpected entry " << name;
    StateDict state = testing_util::crash_state::MakeState(nullptr, 0);
    const std::string dir = absl::StrCat(root, "/", name);
    absl::StatusOr<LoadResult> loaded = Load(&state, dir);
    ASSERT_TRUE(loaded.ok()) << name << ": " << loaded.status();
    EXPECT_EQ(loaded->step, step);
    for (int i = 0; i < testing_util::crash_state::kTensors; ++i) {
      EXPECT_TRUE(testing_util::BitwiseEqual(
          state.Find(testing_util::crash_state::Key(i))->tensor,
          testing_util::crash_state::Full(i, step)))
          << name << " tensor " << i;
    }
    EXPECT_EQ(state.Find("count")->tensor.data<int64_t>()[0], step);
    EXPECT_EQ(*state.bytes("loader"), testing_util::crash_state::Bytes(step));
  }
}

TEST(CrashTest, KilledSavesLeaveTheLastCommittedCheckpointLoadable) {
  const std::string root = testing_util::FreshDir("crash");
  constexpr int kRuns = 8;
  int killed_while_writing = 0;
  int64_t last_reported = 0;
  uint64_t random = 12345;
  for (int run = 0; run < kRuns; ++run) {
    SCOPED_TRACE(absl::StrCat("run ", run));
    Child child = Start(root);
    // Let each run commit once, so there is always a previous checkpoint.
    std::vector<int64_t> commits =
        ReadCommits(&child, absl::Now() + absl::Seconds(30));
    ASSERT_FALSE(commits.empty()) << "the writer committed nothing";
    last_reported = commits.back();
    bool writing = false;
    if (run % 2 == 0) {
      // Kill while a data file of the next checkpoint is being written.
      const absl::Time deadline = absl::Now() + absl::Seconds(20);
      while (!(writing = WritingNow(root)) && absl::Now() < deadline) {
        ::usleep(200);
      }
    } else {
      random = random * 6364136223846793005ull + 1442695040888963407ull;
      ::usleep(static_cast<useconds_t>((random >> 33) % 600000));
      writing = WritingNow(root);
    }
    ASSERT_EQ(::kill(child.pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child.pid, &status, 0), child.pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the writer exited on its own (status " << status << ")";
    // Commits reported before the kill count too.
    for (int64_t step :
         ReadCommits(&child, absl::Now() + absl::Milliseconds(50))) {
      last_reported = step;
    }
    ::close(child.out);
    killed_while_writing += writing ? 1 : 0;

    absl::StatusOr<std::string> latest = LatestCheckpoint(root);
    ASSERT_TRUE(latest.ok()) << latest.status();
    int64_t latest_step = 0;
    ASSERT_TRUE(
        absl::SimpleAtoi(latest->substr(latest->rfind('-') + 1), &latest_step));
    EXPECT_GE(latest_step, last_reported);
    CheckRoot(root);
    std::cout << "run " << run << ": killed "
              << (writing ? "while writing a data file" : "at a random moment")
              << "; last reported commit " << last_reported
              << ", newest on disk " << latest_step << ", entries:";
    const absl::StatusOr<std::vector<std::string>> names = ListDir(root);
    ASSERT_TRUE(names.ok());
    for (const std::string& name : *names) std::cout << " " << name;
    std::cout << "\n";
  }
  EXPECT_GE(killed_while_writing, kRuns / 2);
}

}  // namespace
}  // namespace fsdpp
