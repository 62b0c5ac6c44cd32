// tools/launch: argument parsing, rank environments and the process
// supervisor; see launch.h.
//
// The supervisor is a small state machine driven by one poll() loop:
//   kRunning  -> ranks run; the first failure (or SIGINT/SIGTERM to the
//                launcher) sends SIGTERM to every rank's process group;
//   kStopping -> waits up to the grace period for the groups to empty, then
//                sends SIGKILL;
//   kKilling  -> waits a short fixed time for the killed processes to be
//                reaped and their pipes to close, then gives up.
// Rank exits are detected with waitpid(), never by pipe EOF, because a
// rank's descendants may keep its pipes open after it exits. Signals are
// blocked across fork() so a child never runs the launcher's handlers.
#include "runtime/launch.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "comm/tcp_store.h"
#include "core/parallel.h"
#include "core/status.h"
#include "runtime/elastic.h"

extern char** environ;

namespace fsdpp {
namespace launch {
namespace {

using Clock = std::chrono::steady_clock;

// How long to wait for SIGKILLed processes to be reaped and for their pipes
// to close. SIGKILL cannot be caught, so this only matters for processes in
// uninterruptible sleep or descendants that left their rank's process group.
constexpr std::chrono::seconds kKillWait(2);

// At most this many reads of kReadChunk bytes from one pipe per wake-up, so
// one chatty rank cannot starve the others.
constexpr int kMaxReadsPerPump = 4;
constexpr size_t kReadChunk = 64 * 1024;

// Longest poll() sleep while the job is being stopped.
constexpr int kStopTickMs = 50;

// Upper bound on --grace_period_s (a day) so deadlines cannot overflow.
constexpr double kMaxGracePeriodS = 86400.0;

// Elastic: how often a running launcher asks the rendezvous store whether
// its round must restart, and the deadline of one store exchange (a store
// host that stopped answering is given up on after it).
constexpr std::chrono::milliseconds kRendezvousTick(500);
constexpr absl::Duration kStoreExchangeTimeout = absl::Seconds(10);

// Set by the signal handlers; read (never written) by the event loop, which
// compares them with the counts it has already handled.
volatile sig_atomic_t g_sigint_count = 0;
volatile sig_atomic_t g_sigterm_count = 0;
// Write end of the self-pipe that wakes poll(); -1 outside RunLaunch.
int g_wake_fd = -1;

void OnSignal(int signo) {
  const int saved_errno = errno;
  if (signo == SIGINT) g_sigint_count = g_sigint_count + 1;
  if (signo == SIGTERM) g_sigterm_count = g_sigterm_count + 1;
  const char byte = 0;
  if (write(g_wake_fd, &byte, 1) < 0) {
    // The pipe is full, so a wake-up is already pending.
  }
  errno = saved_errno;
}

// Writes all of `data` to `fd`, retrying short writes. Output to a reader
// that has gone away (EPIPE) is dropped: the job keeps running regardless.
void WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd = {fd, POLLOUT, 0};
      poll(&pfd, 1, 100);
    } else {
      return;
    }
  }
}

// Prints "launch: <message>" on the launcher's stderr.
void Message(absl::string_view message) {
  WriteAll(STDERR_FILENO, absl::StrCat("launch: ", message, "\n"));
}

std::string ErrnoMessage(absl::string_view what, int err) {
  return absl::StrCat(what, ": ", strerror(err));
}

absl::Status ParseIntFlag(absl::string_view name, absl::string_view value,
                          int* out) {
  if (!absl::SimpleAtoi(value, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, "=", value, " is not an integer"));
  }
  return absl::OkStatus();
}

absl::Status ParseFlag(absl::string_view name, const std::string& value,
                       LaunchOptions* options) {
  if (name == "nproc_per_node") {
    return ParseIntFlag(name, value, &options->nproc_per_node);
  }
  if (name == "nnodes") return ParseNnodes(value, options);
  if (name == "rdzv_last_call_s" || name == "rdzv_timeout_s") {
    double* out = name == "rdzv_last_call_s" ? &options->rdzv_last_call_s
                                             : &options->rdzv_timeout_s;
    if (!absl::SimpleAtod(value, out) || !std::isfinite(*out) || *out < 0 ||
        *out > kMaxGracePeriodS) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", name, "=", value, " is not a number of seconds in [0, ",
          kMaxGracePeriodS, "]"));
    }
    return absl::OkStatus();
  }
  if (name == "node_rank") {
    return ParseIntFlag(name, value, &options->node_rank);
  }
  if (name == "master_port") {
    return ParseIntFlag(name, value, &options->master_port);
  }
  if (name == "master_addr") {
    options->master_addr = value;
    return absl::OkStatus();
  }
  if (name == "max_restarts") {
    return ParseIntFlag(name, value, &options->max_restarts);
  }
  if (name == "grace_period_s") {
    if (!absl::SimpleAtod(value, &options->grace_period_s)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--grace_period_s=", value, " is not a number"));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
}

bool IsKnownFlag(absl::string_view name) {
  return name == "nproc_per_node" || name == "nnodes" || name == "node_rank" ||
         name == "master_addr" || name == "master_port" ||
         name == "grace_period_s" || name == "max_restarts" ||
         name == "rdzv_last_call_s" || name == "rdzv_timeout_s";
}

absl::Status Validate(const LaunchOptions& options) {
  if (options.nproc_per_node < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nproc_per_node=", options.nproc_per_node, " must be at least 1"));
  }
  if (options.nnodes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes=", options.nnodes, " must be at least 1"));
  }
  if (static_cast<int64_t>(options.nnodes) * options.nproc_per_node > INT_MAX) {
    return absl::InvalidArgumentError(
        "--nnodes * --nproc_per_node does not fit in an int");
  }
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--node_rank=", options.node_rank, " must be in [0, ",
                     options.nnodes, ") for --nnodes=", options.nnodes));
  }
  if (options.master_addr.empty()) {
    return absl::InvalidArgumentError("--master_addr must not be empty");
  }
  if (options.elastic() && options.master_port > 65534) {
    return absl::InvalidArgumentError(
        absl::StrCat("--master_port=", options.master_port,
                     " leaves no port for the ranks' store (port + 1) of an "
                     "elastic job"));
  }
  if (options.master_port < 1 || options.master_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--master_port=", options.master_port, " must be in [1, 65535]"));
  }
  if (!std::isfinite(options.grace_period_s) || options.grace_period_s < 0 ||
      options.grace_period_s > kMaxGracePeriodS) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grace_period_s=", options.grace_period_s,
                     " must be in [0, ", kMaxGracePeriodS, "]"));
  }
  if (options.max_restarts < 0 || options.max_restarts > 1000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_restarts=", options.max_restarts, " must be in [0, 1000]"));
  }
  if (options.program.empty()) {
    return absl::InvalidArgumentError("missing PROGRAM");
  }
  return absl::OkStatus();
}

// Makes sure fds 0-2 are open so that pipe() never returns one of them,
// which would break the dup2() calls in the child.
void EnsureStandardFds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int null_fd = open("/dev/null", O_RDWR);
      if (null_fd >= 0 && null_fd != fd) close(null_fd);
    }
  }
}

// One end of a rank's stdout or stderr pipe.
struct Stream {
  Stream(int dest, std::string prefix, TerminalState* terminal)
      : dest_fd(dest),
        prefixer(std::move(prefix), LinePrefixer::kDefaultMaxLineBytes,
                 terminal) {}
  int fd = -1;  // Read end (non-blocking); -1 once closed.
  int dest_fd;  // Where prefixed lines go: the launcher's fd 1 or 2.
  LinePrefixer prefixer;
};

// A local rank: its process (and process group) and its two output pipes.
struct Rank {
  Rank(int local, int global, TerminalState* out_terminal,
       TerminalState* err_terminal)
      : local_rank(local),
        global_rank(global),
        out(STDOUT_FILENO, absl::StrCat("[rank ", global, "] "), out_terminal),
        err(STDERR_FILENO, absl::StrCat("[rank ", global, "] "), err_terminal) {
  }
  int local_rank;
  int global_rank;
  pid_t pid = -1;            // Also the process group id.
  bool running = false;      // Started and not yet reaped.
  bool group_alive = false;  // Its process group may still have members.
  Stream out;
  Stream err;
};

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options)
      : options_(options),
        grace_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(options.grace_period_s))) {}
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  int Run();

 private:
  enum class Phase { kRunning, kStopping, kKilling };

  absl::Status SetUp();
  void TearDown();
  absl::Status Spawn(Rank& rank);
  void Pump(Stream& stream);
  void Close(Stream& stream);
  void Reap();
  void OnRankExit(Rank& rank, int wait_status);
  void HandleSignals();
  void OnLauncherSignal(int signo);
  void SignalGroups(int signo);
  void RefreshGroups();
  void Stop();
  void Kill(bool after_grace);
  bool Advance();
  void PollOnce();
  // Elastic: connects to (node 0: serves) the rendezvous store.
  absl::Status StartRendezvous();
  // Elastic, while the ranks run: tells the other nodes about a local
  // failure, and stops the local ranks when a restart was asked for or the
  // store is lost.
  void CheckRendezvous();
  // Elastic, after the ranks of a round ended: true to run another round.
  bool NextRound();

  const LaunchOptions& options_;
  // This round's view of the options: nnodes, node_rank and master_port of
  // the ranks (the same as options_ unless elastic).
  LaunchOptions round_options_;
  const Clock::duration grace_;
  std::vector<Rank> ranks_;
  // Status lines of the ranks (LinePrefixer), when stdout is a terminal.
  TerminalState terminal_;
  bool live_status_ = false;
  std::vector<std::string> base_env_;
  int num_cpus_ = 1;
  int devnull_fd_ = -1;
  int wake_read_fd_ = -1;
  int wake_write_fd_ = -1;
  Phase phase_ = Phase::kRunning;
  int exit_code_ = 0;
  bool interrupted_ = false;  // SIGINT / SIGTERM to the launcher
  int restart_count_ = 0;
  int launch_round_ = 0;  // times the ranks were started before
  std::optional<Clock::time_point> deadline_;
  sig_atomic_t seen_sigint_ = 0;
  sig_atomic_t seen_sigterm_ = 0;
  // What SetUp() changed and TearDown() puts back.
  bool handlers_installed_ = false;
  struct sigaction old_int_, old_term_, old_chld_, old_pipe_;
  sigset_t old_mask_;
  int old_subreaper_ = 0;
  std::vector<char> read_buffer_ = std::vector<char>(kReadChunk);
  // Elastic state.
  std::unique_ptr<TcpStore> rdzv_store_;
  std::unique_ptr<ElasticRendezvous> rdzv_;
  // OomKillCount() when the ranks started, and the ranks' memory reports.
  int64_t oom_kills_at_start_ = -1;
  std::string report_dir_;
  Clock::time_point next_rdzv_check_;
  std::string failure_;        // "rank R exited ..." of this round
  bool failure_told_ = false;  // the other nodes were asked to restart
  std::string peer_reason_;    // why another node asked to restart
  bool rdzv_lost_ = false;     // the rendezvous store stopped answering
};

absl::Status Launcher::SetUp() {
  EnsureStandardFds();
  num_cpus_ = AvailableCpus();
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (absl::StartsWith(*e, "FSDPP_LIVE_STATUS=") ||
        absl::StartsWith(*e, "TORCHELASTIC_RESTART_COUNT=") ||
        absl::StartsWith(*e, absl::StrCat(kLaunchRoundEnv, "=")) ||
        absl::StartsWith(*e, absl::StrCat(kMemoryReportEnv, "="))) {
      continue;
    }
    base_env_.emplace_back(*e);
  }
  if (std::getenv(kJobIdEnv) == nullptr) {
    // One identity for the whole job, kept over restarts and rounds.
    std::random_device random;
    base_env_.push_back(absl::StrFormat(
        "%s=%08x%08x-%d", kJobIdEnv, random(), random(),
        static_cast<int>(absl::ToUnixSeconds(absl::Now()) % 1000000)));
  }
  live_status_ = isatty(STDOUT_FILENO);
  if (live_status_) base_env_.push_back("FSDPP_LIVE_STATUS=1");
  // For telling an out-of-memory kill apart, and what the rank last said
  // about its memory.
  oom_kills_at_start_ = OomKillCount();
  char report_template[] = "/tmp/fsdpp_launch.XXXXXX";
  if (mkdtemp(report_template) != nullptr) report_dir_ = report_template;
  devnull_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull_fd_ < 0) {
    return absl::InternalError(ErrnoMessage("open /dev/null", errno));
  }
  int wake[2];
  if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(ErrnoMessage("pipe", errno));
  }
  wake_read_fd_ = wake[0];
  wake_write_fd_ = wake[1];
  g_wake_fd = wake_write_fd_;
  seen_sigint_ = g_sigint_count;
  seen_sigterm_ = g_sigterm_count;

  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, &old_int_);
  sigaction(SIGTERM, &action, &old_term_);
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigaction(SIGCHLD, &action, &old_chld_);
  // A vanished reader of our stdout must not kill the launcher (and orphan
  // the job); writes then fail with EPIPE and are dropped.
  struct sigaction ignore;
  memset(&ignore, 0, sizeof(ignore));
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGPIPE, &ignore, &old_pipe_);
  // The handlers must run even if our parent started us with them blocked.
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, SIGINT);
  sigaddset(&handled, SIGTERM);
  sigaddset(&handled, SIGCHLD);
  sigprocmask(SIG_UNBLOCK, &handled, &old_mask_);

  // Orphans of the ranks' subtrees become our children, so we reap them and
  // their process groups empty without relying on init.
  prctl(PR_GET_CHILD_SUBREAPER, &old_subreaper_);
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  handlers_installed_ = true;
  return absl::OkStatus();
}

void Launcher::TearDown() {
  for (Rank& rank : ranks_) {
    Close(rank.out);
    Close(rank.err);
  }
  Reap();
  if (!report_dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(report_dir_, ignored);
  }
  if (handlers_installed_) {
    prctl(PR_SET_CHILD_SUBREAPER, old_subreaper_);
    sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGCHLD, &old_chld_, nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
  }
  g_wake_fd = -1;
  if (wake_read_fd_ >= 0) close(wake_read_fd_);
  if (wake_write_fd_ >= 0) close(wake_write_fd_);
  if (devnull_fd_ >= 0) close(devnull_fd_);
}

absl::Status Launcher::Spawn(Rank& rank) {
  // Everything the child needs is built before fork().
  std::vector<std::string> env =
      RankEnvironment(round_options_, rank.local_rank, base_env_, num_cpus_);
  env.push_back(absl::StrCat("TORCHELASTIC_RESTART_COUNT=", restart_count_));
  env.push_back(absl::StrCat(kLaunchRoundEnv, "=", launch_round_));
  if (!report_dir_.empty()) {
    env.push_back(absl::StrCat(kMemoryReportEnv, "=", report_dir_,
                               "/memory.rank", rank.global_rank));
  }
  std::vector<char*> envp;
  for (std::string& entry : env) envp.push_back(entry.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = options_.program;
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const std::string exec_error =
      absl::StrCat("launch: cannot execute '", args[0], "': ");

  int out_pipe[2];
  int err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    return absl::InternalError(ErrnoMessage("pipe", errno));
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    const int err = errno;
    close(out_pipe[0]);
    close(out_pipe[1]);
    return absl::InternalError(ErrnoMessage("pipe", err));
  }

  const pid_t launcher_pid = getpid();
  sigset_t all_signals;
  sigset_t saved_mask;
  sigfillset(&all_signals);
  sigprocmask(SIG_BLOCK, &all_signals, &saved_mask);
  const pid_t pid = fork();
  if (pid == 0) {
    // Child. Only plain system calls (and strerror on the way out) are made
    // here: an elastic launcher's store thread may hold locks that fork()
    // copied.
    setpgid(0, 0);
    // If the launcher itself is SIGKILLed, its ranks must not live on. The
    // getppid() check closes the race with a launcher that died before this.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher_pid) _exit(128 + SIGKILL);
    struct sigaction dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (int signo : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) {
      sigaction(signo, &dfl, nullptr);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    // Ranks are not in the terminal's foreground group: reading the terminal
    // would stop them, so their stdin is /dev/null.
    dup2(devnull_fd_, STDIN_FILENO);
    dup2(out_pipe[1], STDOUT_FILENO);
    dup2(err_pipe[1], STDERR_FILENO);
    execvpe(argv[0], argv.data(), envp.data());
    const int err = errno;
    const char* reason = strerror(err);
    if (write(STDERR_FILENO, exec_error.data(), exec_error.size()) < 0 ||
        write(STDERR_FILENO, reason, strlen(reason)) < 0 ||
        write(STDERR_FILENO, "\n", 1) < 0) {
      // Nothing left to report to.
    }
    _exit(err == ENOENT ? 127 : 126);
  }
  const int fork_errno = errno;
  sigprocmask(SIG_SETMASK, &saved_mask, nullptr);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (pid < 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    return absl::InternalError(ErrnoMessage("fork", fork_errno));
  }
  // Also done here so the group exists before we might signal it; fails
  // harmlessly (EACCES) if the child has already exec'd.
  setpgid(pid, pid);
  fcntl(out_pipe[0], F_SETFL, O_NONBLOCK);
  fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
  rank.pid = pid;
  rank.running = true;
  rank.group_alive = true;
  rank.out.fd = out_pipe[0];
  rank.err.fd = err_pipe[0];
  return absl::OkStatus();
}

void Launcher::Pump(Stream& stream) {
  for (int i = 0; i < kMaxReadsPerPump && stream.fd >= 0; ++i) {
    const ssize_t n = read(stream.fd, read_buffer_.data(), read_buffer_.size());
    if (n > 0) {
      WriteAll(stream.dest_fd,
               stream.prefixer.Append(absl::string_view(
                   read_buffer_.data(), static_cast<size_t>(n))));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      Close(stream);  // EOF (or a read error, which we treat alike).
    }
  }
}

void Launcher::Close(Stream& stream) {
  if (stream.fd < 0) return;
  WriteAll(stream.dest_fd, stream.prefixer.Finish());
  close(stream.fd);
  stream.fd = -1;
}

void Launcher::Reap() {
  while (true) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno == EINTR) continue;
    if (pid <= 0) return;
    for (Rank& rank : ranks_) {
      if (rank.running && rank.pid == pid) {
        OnRankExit(rank, status);
        break;
      }
    }
    // Other pids are orphaned descendants reparented to us (subreaper).
  }
}

void Launcher::OnRankExit(Rank& rank, int wait_status) {
  rank.running = false;
  // Show what the rank wrote before it died ahead of our verdict on it.
  Pump(rank.out);
  Pump(rank.err);
  if (WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0) return;
  if (phase_ != Phase::kRunning) return;  // Collateral of the shutdown.
  std::string what;
  if (WIFSIGNALED(wait_status)) {
    const int signo = WTERMSIG(wait_status);
    exit_code_ = 128 + signo;
    what = absl::StrCat("was killed by signal ", SignalName(signo));
    const int64_t oom_kills = signo == SIGKILL ? OomKillCount() : -1;
    if (oom_kills_at_start_ >= 0 && oom_kills > oom_kills_at_start_) {
      what = absl::StrCat(
          "was killed by the out-of-memory killer (SIGKILL; the kernel's "
          "oom_kill count went from ",
          oom_kills_at_start_, " to ", oom_kills, ")");
      std::ifstream report(
          absl::StrCat(report_dir_, "/memory.rank", rank.global_rank));
      std::string last;
      if (!report_dir_.empty() && std::getline(report, last) && !last.empty()) {
        absl::StrAppend(&what, "; its last memory report: ", last);
      }
    }
  } else {
    exit_code_ = WEXITSTATUS(wait_status);
    what = absl::StrCat("exited with status ", exit_code_);
  }
  Message(absl::StrCat("rank ", rank.global_rank, " ", what));
  failure_ = absl::StrCat("rank ", rank.global_rank, " ", what);
  Stop();
}

void Launcher::HandleSignals() {
  char drain[64];
  while (read(wake_read_fd_, drain, sizeof(drain)) > 0) {
  }
  const sig_atomic_t sigints = g_sigint_count;
  if (sigints != seen_sigint_) {
    seen_sigint_ = sigints;
    OnLauncherSignal(SIGINT);
  }
  const sig_atomic_t sigterms = g_sigterm_count;
  if (sigterms != seen_sigterm_) {
    seen_sigterm_ = sigterms;
    OnLauncherSignal(SIGTERM);
  }
}

void Launcher::OnLauncherSignal(int signo) {
  interrupted_ = true;  // never restart after the launcher was told to stop
  if (phase_ == Phase::kRunning) {
    exit_code_ = 128 + signo;
    Message(
        absl::StrCat("received ", SignalName(signo), "; stopping all ranks"));
    Stop();
  } else if (phase_ == Phase::kStopping) {
    Message(absl::StrCat("received ", SignalName(signo),
                         " again; killing all ranks"));
    Kill(/*after_grace=*/false);
  }
}

void Launcher::SignalGroups(int signo) {
  for (Rank& rank : ranks_) {
    if (!rank.group_alive) continue;
    if (killpg(rank.pid, signo) != 0 && errno == ESRCH && !rank.running) {
      rank.group_alive = false;
    }
    // A rank that moved itself to another group (setsid, job control) is
    // still our child, so its pid is safe to signal directly.
    if (rank.running && getpgid(rank.pid) != rank.pid) kill(rank.pid, signo);
  }
}

void Launcher::RefreshGroups() {
  for (Rank& rank : ranks_) {
    // While the leader is unreaped the group id cannot be reused; after that
    // an empty group is marked dead once and never signalled again.
    if (rank.group_alive && !rank.running && killpg(rank.pid, 0) != 0 &&
        errno == ESRCH) {
      rank.group_alive = false;
    }
  }
}

void Launcher::Stop() {
  phase_ = Phase::kStopping;
  deadline_ = Clock::now() + grace_;
  SignalGroups(SIGTERM);
  SignalGroups(SIGCONT);  // Stopped processes must see the SIGTERM too.
}

void Launcher::Kill(bool after_grace) {
  RefreshGroups();
  if (after_grace) {  // Otherwise the caller has already said why.
    for (const Rank& rank : ranks_) {
      if (rank.running) {
        Message(absl::StrCat("rank ", rank.global_rank, " still running after ",
                             options_.grace_period_s,
                             "s grace period; sending SIGKILL"));
      } else if (rank.group_alive) {
        Message(absl::StrCat("processes left by rank ", rank.global_rank,
                             " still running; sending SIGKILL"));
      }
    }
  }
  SignalGroups(SIGKILL);
  phase_ = Phase::kKilling;
  deadline_ = Clock::now() + kKillWait;
}

// Moves the state machine on; returns false when the launcher is done.
bool Launcher::Advance() {
  RefreshGroups();
  const bool all_reaped = std::none_of(ranks_.begin(), ranks_.end(),
                                       [](const Rank& r) { return r.running; });
  const bool groups_empty =
      std::none_of(ranks_.begin(), ranks_.end(),
                   [](const Rank& r) { return r.group_alive; });
  const bool pipes_closed = std::none_of(
      ranks_.begin(), ranks_.end(),
      [](const Rank& r) { return r.out.fd >= 0 || r.err.fd >= 0; });
  const Clock::time_point now = Clock::now();
  switch (phase_) {
    case Phase::kRunning:
      if (!all_reaped) return true;
      if (!groups_empty) {
        Message("all ranks exited; stopping the processes they left running");
        Stop();
        return true;
      }
      if (pipes_closed) return false;
      // Only processes that left their rank's group still hold the pipes.
      if (!deadline_.has_value()) deadline_ = now + grace_;
      if (now < *deadline_) return true;
      Message("all ranks exited but their output is still open; detaching");
      return false;
    case Phase::kStopping:
      if (all_reaped && groups_empty && pipes_closed) return false;
      if (now >= *deadline_) Kill(/*after_grace=*/true);
      return true;
    case Phase::kKilling:
      if (all_reaped && groups_empty && pipes_closed) return false;
      if (now < *deadline_) return true;
      for (const Rank& rank : ranks_) {
        if (rank.running || rank.group_alive) {
          Message(absl::StrCat("processes of rank ", rank.global_rank,
                               " did not die after SIGKILL; giving up"));
        }
      }
      return false;
  }
  return false;
}

void Launcher::PollOnce() {
  std::vector<pollfd> fds;
  std::vector<Stream*> streams;
  fds.push_back({wake_read_fd_, POLLIN, 0});
  for (Rank& rank : ranks_) {
    for (Stream* stream : {&rank.out, &rank.err}) {
      if (stream->fd < 0) continue;
      fds.push_back({stream->fd, POLLIN, 0});
      streams.push_back(stream);
    }
  }
  int timeout_ms = -1;
  if (deadline_.has_value()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        *deadline_ - Clock::now());
    // +1 so we do not wake just before the deadline and spin.
    timeout_ms =
        static_cast<int>(std::clamp<int64_t>(left.count() + 1, 0, INT_MAX));
  }
  if (rdzv_ != nullptr && phase_ == Phase::kRunning) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        next_rdzv_check_ - Clock::now());
    const int tick = static_cast<int>(
        std::clamp<int64_t>(left.count() + 1, 0, kRendezvousTick.count()));
    timeout_ms = timeout_ms < 0 ? tick : std::min(timeout_ms, tick);
  }
  if (phase_ != Phase::kRunning) {
    // While stopping, group members that are not our children can die
    // without waking us; look again at least this often.
    timeout_ms =
        timeout_ms < 0 ? kStopTickMs : std::min(timeout_ms, kStopTickMs);
  }
  const int n = poll(fds.data(), fds.size(), timeout_ms);
  if (n < 0) {
    if (errno == EINTR) return;
    Message(ErrnoMessage("poll", errno));
    if (phase_ == Phase::kRunning) {
      exit_code_ = 1;
      Stop();
    }
    poll(nullptr, 0, 10);  // Do not spin if the error persists.
    return;
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents != 0) Pump(*streams[i - 1]);
  }
}

int Launcher::Run() {
  if (absl::Status status = SetUp(); !status.ok()) {
    Message(status.message());
    TearDown();
    return 1;
  }
  round_options_ = options_;
  if (options_.elastic()) {
    if (absl::Status status = StartRendezvous(); !status.ok()) {
      Message(status.message());
      TearDown();
      return 1;
    }
  }
  while (true) {
    if (rdzv_ != nullptr) {
      absl::StatusOr<ElasticRound> round = rdzv_->Join();
      if (!round.ok()) {
        Message(absl::StrCat("elastic rendezvous at ", options_.master_addr,
                             ":", options_.master_port,
                             " failed: ", round.status().message()));
        exit_code_ = 1;
        // Cancelled by SIGINT / SIGTERM: exit as for those (130 / 143).
        if (absl::IsCancelled(round.status())) HandleSignals();
        break;
      }
      round_options_.nnodes = static_cast<int>(round->members.size());
      round_options_.node_rank = round->group_rank;
      round_options_.master_port = options_.master_port + 1;
      Message(absl::StrCat("elastic round ", round->round, ": nodes [",
                           absl::StrJoin(round->members, ","), "], world size ",
                           round->world_size, "; node ", options_.node_rank,
                           " runs ranks ", round->rank_offset, "-",
                           round->rank_offset + options_.nproc_per_node - 1));
      failure_.clear();
      failure_told_ = false;
      peer_reason_.clear();
      next_rdzv_check_ = Clock::now() + kRendezvousTick;
    }
    const int world_offset =
        round_options_.node_rank * round_options_.nproc_per_node;
    ranks_.clear();
    ranks_.reserve(options_.nproc_per_node);
    for (int local = 0; local < options_.nproc_per_node; ++local) {
      // stderr lines erase a status line only on the same terminal.
      ranks_.emplace_back(
          local, world_offset + local, live_status_ ? &terminal_ : nullptr,
          live_status_ && isatty(STDERR_FILENO) ? &terminal_ : nullptr);
    }
    bool spawned = true;
    for (Rank& rank : ranks_) {
      if (absl::Status status = Spawn(rank); !status.ok()) {
        Message(absl::StrCat("cannot start rank ", rank.global_rank, ": ",
                             status.message()));
        exit_code_ = 1;
        spawned = false;
        Stop();
        break;
      }
    }
    ++launch_round_;
    while (true) {
      HandleSignals();
      Reap();
      if (rdzv_ != nullptr) CheckRendezvous();
      if (!Advance()) break;
      PollOnce();
    }
    if (rdzv_ != nullptr) {
      if (!spawned || !NextRound()) break;
      phase_ = Phase::kRunning;
      exit_code_ = 0;
      deadline_.reset();
      continue;
    }
    if (exit_code_ == 0 || interrupted_ || !spawned) break;
    if (restart_count_ >= options_.max_restarts) {
      if (options_.max_restarts > 0) {
        Message(absl::StrCat("no restarts left (--max_restarts=",
                             options_.max_restarts, "): the job failed"));
      }
      break;
    }
    ++restart_count_;
    Message(absl::StrCat("restarting the local ranks (restart ", restart_count_,
                         " of ", options_.max_restarts, ")"));
    phase_ = Phase::kRunning;
    exit_code_ = 0;
    deadline_.reset();
  }
  TearDown();
  return exit_code_;
}

absl::Status Launcher::StartRendezvous() {
  const bool host = options_.node_rank == 0;
  const absl::Duration timeout = absl::Seconds(options_.rdzv_timeout_s);
  const absl::Time deadline = absl::Now() + timeout;
  // Short connection attempts up to the rendezvous timeout, so the store's
  // exchanges keep their short deadline (a lost host is noticed in seconds).
  while (true) {
    absl::StatusOr<std::unique_ptr<TcpStore>> store =
        TcpStore::Create(options_.master_addr, options_.master_port, host,
                         std::min(kStoreExchangeTimeout, timeout));
    if (store.ok()) {
      rdzv_store_ = std::move(*store);
      break;
    }
    if (host || absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          host ? "cannot serve" : "cannot reach",
          " the elastic rendezvous store at ", options_.master_addr, ":",
          options_.master_port, " (node 0): ", store.status().message()));
    }
    if (interrupted_ || g_sigint_count != 0 || g_sigterm_count != 0) {
      return absl::CancelledError("interrupted while waiting for node 0");
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  ElasticOptions eo;
  eo.node_id = options_.node_rank;
  eo.nproc_per_node = options_.nproc_per_node;
  eo.min_nodes = options_.min_nodes;
  eo.max_nodes = options_.max_nodes;
  eo.last_call = absl::Seconds(options_.rdzv_last_call_s);
  eo.timeout = timeout;
  // SIGINT / SIGTERM while a round forms: give up (the handlers only count).
  eo.cancelled = [] { return g_sigint_count != 0 || g_sigterm_count != 0; };
  rdzv_ = std::make_unique<ElasticRendezvous>(rdzv_store_.get(), eo);
  return absl::OkStatus();
}

void Launcher::CheckRendezvous() {
  if (rdzv_lost_) return;
  const std::string where =
      absl::StrCat(options_.master_addr, ":", options_.master_port);
  if (!failure_.empty() && !failure_told_) {
    failure_told_ = true;
    const absl::Status told = rdzv_->RequestRestart(
        absl::StrCat("fail: node ", options_.node_rank, ": ", failure_));
    if (!told.ok()) {
      rdzv_lost_ = true;
      Message(absl::StrCat("elastic rendezvous store at ", where,
                           " (node 0) lost: ", told.message()));
    }
    return;
  }
  if (phase_ != Phase::kRunning || Clock::now() < next_rdzv_check_) return;
  next_rdzv_check_ = Clock::now() + kRendezvousTick;
  absl::StatusOr<std::optional<std::string>> reason = rdzv_->RestartRequested();
  if (!reason.ok()) {
    rdzv_lost_ = true;
    Message(absl::StrCat("elastic rendezvous store at ", where,
                         " (node 0) lost: ", reason.status().message(),
                         "; stopping the local ranks"));
    exit_code_ = 1;
    Stop();
    return;
  }
  if (!reason->has_value()) return;
  peer_reason_ = **reason;
  Message(absl::StrCat("restart of the round asked for (", peer_reason_,
                       "); stopping the local ranks"));
  Stop();
}

bool Launcher::NextRound() {
  if (rdzv_lost_) {
    exit_code_ = std::max(exit_code_, 1);
    return false;
  }
  if (interrupted_) return false;
  if (failure_.empty() && peer_reason_.empty()) {
    // Every local rank finished: say so; node 0 keeps the store up until
    // every node did.
    absl::Status done = rdzv_->MarkFinished();
    if (done.ok() && options_.node_rank == 0) {
      done = rdzv_->WaitAllFinished(absl::Seconds(options_.rdzv_timeout_s));
    }
    if (!done.ok())
      Message(absl::StrCat("elastic rendezvous: ", done.message()));
    return false;
  }
  // A failure anywhere (ours or another node's) uses up a restart; a node
  // that asked to join does not.
  const bool failed =
      !failure_.empty() || absl::StartsWith(peer_reason_, "fail");
  if (failed) {
    if (restart_count_ >= options_.max_restarts) {
      Message(absl::StrCat(
          "no restarts left (--max_restarts=", options_.max_restarts, ")"));
      exit_code_ = std::max(exit_code_, 1);
      return false;
    }
    ++restart_count_;
  }
  Message(absl::StrCat("restarting the local ranks in the next elastic round",
                       failed ? absl::StrCat(" (restart ", restart_count_,
                                             " of ", options_.max_restarts, ")")
                              : std::string(" (not counted: a node joins)")));
  return true;
}

}  // namespace

LinePrefixer::LinePrefixer(std::string prefix, size_t max_line_bytes,
                           TerminalState* terminal)
    : prefix_(std::move(prefix)),
      max_line_bytes_(std::max<size_t>(1, max_line_bytes)),
      terminal_(terminal) {}

std::string LinePrefixer::Emit(absl::string_view line) {
  std::string out;
  const bool status = !line.empty() && line[0] == '\r';
  if (status) line.remove_prefix(1);
  if (status && terminal_ != nullptr) {
    if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
    terminal_->status_shown = true;
    return absl::StrCat("\r", prefix_, line, "\033[K");
  }
  if (terminal_ != nullptr && terminal_->status_shown) {
    out = "\r\033[K";  // Erase the status line first.
    terminal_->status_shown = false;
  }
  absl::StrAppend(&out, prefix_, line);
  return out;
}

std::string LinePrefixer::Append(absl::string_view data) {
  std::string out;
  while (!data.empty()) {
    const size_t newline = data.find('\n');
    if (newline == absl::string_view::npos) {
      partial_.append(data.data(), data.size());
      size_t cut = 0;
      while (partial_.size() - cut > max_line_bytes_) {
        out += Emit(absl::StrCat(
            absl::string_view(partial_).substr(cut, max_line_bytes_), "\n"));
        cut += max_line_bytes_;
      }
      partial_.erase(0, cut);
      break;
    }
    partial_.append(data.data(), newline + 1);
    out += Emit(partial_);
    partial_.clear();
    data.remove_prefix(newline + 1);
  }
  return out;
}

std::string LinePrefixer::Finish() {
  std::string out;
  if (!partial_.empty()) {
    out = Emit(absl::StrCat(partial_, "\n"));
    partial_.clear();
  }
  if (terminal_ != nullptr && terminal_->status_shown) {
    out += "\n";  // Keep the last status, end its line.
    terminal_->status_shown = false;
  }
  return out;
}

std::string LaunchUsage() {
  return "Usage: launch [--nproc_per_node=N] [--nnodes=M|MIN:MAX]\n"
         "              [--node_rank=K] [--rdzv_last_call_s=S]\n"
         "              [--rdzv_timeout_s=S]\n"
         "              [--master_addr=HOST] [--master_port=PORT]\n"
         "              [--grace_period_s=S] [--max_restarts=R]\n"
         "              [--] PROGRAM [ARGS...]\n"
         "\n"
         "Starts N copies of PROGRAM (looked up in PATH unless it contains a\n"
         "'/') with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
         "GROUP_RANK, MASTER_ADDR, MASTER_PORT and OMP_NUM_THREADS set, and\n"
         "prefixes their output lines with \"[rank R] \". When a rank fails,\n"
         "or on SIGINT/SIGTERM, the other ranks get SIGTERM and, after the\n"
         "grace period, SIGKILL.\n"
         "\n"
         "  --nproc_per_node=N   ranks on this node (default 1)\n"
         "  --nnodes=M           nodes in the job (default 1); MIN:MAX for an\n"
         "                       elastic job: the launchers meet at node 0's\n"
         "                       MASTER_ADDR:MASTER_PORT, every failure or\n"
         "                       node joining restarts all nodes' ranks at\n"
         "                       the world size of the nodes there (ranks'\n"
         "                       store at MASTER_PORT + 1)\n"
         "  --rdzv_last_call_s=S an elastic round closes S after the last\n"
         "                       node joined, once MIN are in (default 10)\n"
         "  --rdzv_timeout_s=S   longest wait for a round (default 300)\n"
         "  --node_rank=K        this node's index in [0, M) (default 0)\n"
         "  --master_addr=HOST   rendezvous host (default 127.0.0.1)\n"
         "  --master_port=PORT   rendezvous port (default 29500)\n"
         "  --grace_period_s=S   SIGTERM-to-SIGKILL delay (default 5)\n"
         "  --max_restarts=R     after a rank fails, stop the local ranks and\n"
         "                       start them again, up to R times (default 0;\n"
         "                       the ranks see TORCHELASTIC_RESTART_COUNT)\n"
         "\n"
         "Exit status: 0 if all ranks exit 0; else that of the first failing\n"
         "rank (128 + signal if it was killed), 130/143 after SIGINT/SIGTERM,\n"
         "2 for usage errors.\n";
}

absl::Status ParseNnodes(absl::string_view value, LaunchOptions* options) {
  const size_t colon = value.find(':');
  if (colon == absl::string_view::npos) {
    options->min_nodes = options->max_nodes = 0;
    return ParseIntFlag("nnodes", value, &options->nnodes);
  }
  if (!absl::SimpleAtoi(value.substr(0, colon), &options->min_nodes) ||
      !absl::SimpleAtoi(value.substr(colon + 1), &options->max_nodes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes=", value, " is not N or MIN:MAX"));
  }
  if (options->min_nodes < 1 || options->max_nodes < options->min_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes=", value, ": need 1 <= MIN <= MAX"));
  }
  options->nnodes = options->max_nodes;
  return absl::OkStatus();
}

absl::StatusOr<LaunchOptions> ParseLaunchArgs(
    const std::vector<std::string>& args) {
  LaunchOptions options;
  size_t i = 0;
  while (i < args.size()) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // PROGRAM ("-" included).
    if (arg == "-h" || arg == "-help" || arg == "--help") {
      options.help = true;
      return options;
    }
    absl::string_view flag(arg);
    flag.remove_prefix(absl::StartsWith(flag, "--") ? 2 : 1);
    ++i;
    const size_t eq = flag.find('=');
    const absl::string_view name = flag.substr(0, eq);
    if (!IsKnownFlag(name)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", arg));
    }
    std::string value;
    if (eq != absl::string_view::npos) {
      value = std::string(flag.substr(eq + 1));
    } else if (i < args.size()) {
      value = args[i++];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", name, " needs a value"));
    }
    FSDPP_RETURN_IF_ERROR(ParseFlag(name, value, &options));
  }
  options.program.assign(args.begin() + i, args.end());
  FSDPP_RETURN_IF_ERROR(Validate(options));
  return options;
}

std::vector<std::string> RankEnvironment(
    const LaunchOptions& options, int local_rank,
    const std::vector<std::string>& base_env, int num_cpus) {
  const std::pair<const char*, std::string> vars[] = {
      {"RANK",
       absl::StrCat(options.node_rank * options.nproc_per_node + local_rank)},
      {"WORLD_SIZE", absl::StrCat(options.nnodes * options.nproc_per_node)},
      {"LOCAL_RANK", absl::StrCat(local_rank)},
      {"LOCAL_WORLD_SIZE", absl::StrCat(options.nproc_per_node)},
      {"GROUP_RANK", absl::StrCat(options.node_rank)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", absl::StrCat(options.master_port)},
  };
  std::vector<std::string> env;
  env.reserve(base_env.size() + 8);
  bool has_omp_num_threads = false;
  for (const std::string& entry : base_env) {
    const absl::string_view key =
        absl::string_view(entry).substr(0, entry.find('='));
    if (key == "OMP_NUM_THREADS") has_omp_num_threads = true;
    const bool replaced =
        std::any_of(std::begin(vars), std::end(vars),
                    [&](const auto& var) { return key == var.first; });
    if (!replaced) env.push_back(entry);
  }
  for (const auto& [key, value] : vars)
    env.push_back(absl::StrCat(key, "=", value));
  if (!has_omp_num_threads) {
    env.push_back(absl::StrCat(
        "OMP_NUM_THREADS", "=",
        std::max(1, num_cpus / std::max(1, options.nproc_per_node))));
  }
  return env;
}

namespace {

// The value of `key` ("oom_kill") in a "key value" per line file; -1 if the
// file or the key is missing.
int64_t ReadKeyedCount(const std::string& path, absl::string_view key) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, ' ');
    int64_t v = 0;
    if (parts.size() == 2 && parts[0] == key &&
        absl::SimpleAtoi(parts[1], &v)) {
      return v;
    }
  }
  return -1;
}

}  // namespace

int64_t OomKillCount(const std::string& proc_root,
                     const std::string& cgroup_root) {
  std::ifstream f(proc_root + "/self/cgroup");
  std::string line;
  std::string v1_memory, v2;
  while (std::getline(f, line)) {
    // "4:memory:/path" (v1) or "0::/path" (v2).
    std::vector<std::string> parts =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[1] == "memory") v1_memory = parts[2];
    if (parts[0] == "0" && parts[1].empty()) v2 = parts[2];
  }
  if (!v1_memory.empty()) {
    const int64_t n = ReadKeyedCount(
        cgroup_root + "/memory" + v1_memory + "/memory.oom_control",
        "oom_kill");
    if (n >= 0) return n;
  }
  if (!v2.empty()) {
    for (const char* mount : {"", "/unified"}) {
      const int64_t n = ReadKeyedCount(
          absl::StrCat(cgroup_root, mount, v2, "/memory.events"), "oom_kill");
      if (n >= 0) return n;
    }
  }
  return ReadKeyedCount(proc_root + "/vmstat", "oom_kill");
}

std::string SignalName(int signo) {
  const char* abbrev = sigabbrev_np(signo);
  if (abbrev == nullptr) return absl::StrCat("signal ", signo);
  return absl::StrCat("SIG", abbrev);
}

int RunLaunch(const LaunchOptions& options) {
  Launcher launcher(options);
  return launcher.Run();
}

}  // namespace launch
}  // namespace fsdpp
