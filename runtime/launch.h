// runtime/launch: the torchrun-like launcher library behind tools/launch
// (and the trainer and tools/bench, which start their own ranks). It starts
// one process per local rank with the rendezvous environment (RANK,
// WORLD_SIZE, LOCAL_RANK, ...), prefixes every output line with "[rank R] ",
// and tears the whole job down when a rank fails or the launcher is
// interrupted.
//
// Design: every rank runs in its own process group, so SIGTERM/SIGKILL reach
// the subtree the rank started, and the launcher is a child subreaper, so
// orphaned descendants are reaped here and an emptied process group can be
// observed with killpg(pgid, 0). The launcher is single-threaded: one poll()
// loop watches the output pipes and a self-pipe that the signal handlers
// (SIGCHLD, SIGINT, SIGTERM) write to; every wait has a deadline.
#ifndef FSDPP_RUNTIME_LAUNCH_H_
#define FSDPP_RUNTIME_LAUNCH_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fsdpp {
namespace launch {

// Settings of one launcher run (see LaunchUsage() for the command line).
struct LaunchOptions {
  // Processes (local ranks) started on this node.
  int nproc_per_node = 1;
  // Nodes in the job; WORLD_SIZE = nnodes * nproc_per_node.
  int nnodes = 1;
  // This node's index in [0, nnodes); exported as GROUP_RANK.
  int node_rank = 0;
  // Rendezvous host and port, exported as MASTER_ADDR / MASTER_PORT.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Time between SIGTERM and SIGKILL when the job is stopped.
  double grace_period_s = 5.0;
  // After a rank fails, stop the local ranks and start them all again, up
  // to this many times (torchrun's --max_restarts; not after SIGINT /
  // SIGTERM to the launcher). The ranks see TORCHELASTIC_RESTART_COUNT and
  // FSDPP_LAUNCH_ROUND; a trainer resumes from its job's latest checkpoint
  // on its own (kJobIdEnv).
  int max_restarts = 0;
  // Elastic (`--nnodes=MIN:MAX`, max_nodes > 0): the launchers agree on the
  // nodes of each run through an elastic rendezvous (runtime/elastic.h)
  // whose store node 0's launcher serves at master_addr:master_port; the
  // ranks' own store is at master_port + 1. After a failure (within
  // max_restarts) or when a node asks to join, every node's ranks are
  // stopped and the next round starts them again at the world size of the
  // nodes that are there: min_nodes to max_nodes of nproc_per_node ranks.
  // nnodes is max_nodes then; node_rank is the node's identity.
  int min_nodes = 0;
  int max_nodes = 0;
  // A round closes this long after the last node joined, once min_nodes are
  // in (torchrun's last call).
  double rdzv_last_call_s = 10.0;
  // Longest wait for a round to close or for the rendezvous store.
  double rdzv_timeout_s = 300.0;
  bool elastic() const { return max_nodes > 0; }
  // --help was given: print the usage and exit 0; nothing else is checked.
  bool help = false;
  // PROGRAM and its arguments (program[0] is looked up in PATH unless it
  // contains a '/').
  std::vector<std::string> program;
};

// The command-line usage text, ending in a newline.
std::string LaunchUsage();

// Parses the launcher's arguments (argv without argv[0]). Flags are
// "--name=value" or "--name value" (one or two dashes); the first argument
// that is not a flag, or everything after "--", is the program and its
// arguments. Returns InvalidArgument for unknown flags, malformed or
// out-of-range values and a missing program.
absl::StatusOr<LaunchOptions> ParseLaunchArgs(
    const std::vector<std::string>& args);

// Sets options->nnodes from "N", or min_nodes / max_nodes (and nnodes = MAX)
// from "MIN:MAX"; InvalidArgument naming the value otherwise.
absl::Status ParseNnodes(absl::string_view value, LaunchOptions* options);

// The environment ("KEY=VALUE" entries) of local rank `local_rank`: `base_env`
// with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR and MASTER_PORT replaced, and OMP_NUM_THREADS set to
// max(1, num_cpus / nproc_per_node) unless `base_env` already has it.
std::vector<std::string> RankEnvironment(
    const LaunchOptions& options, int local_rank,
    const std::vector<std::string>& base_env, int num_cpus);

// "SIGKILL" for SIGKILL and so on; "signal N" for numbers without a name.
std::string SignalName(int signo);

// How many processes the kernel's out-of-memory killer has killed: in this
// process's memory cgroup (v1 memory.oom_control, v2 memory.events), else
// on the whole machine (/proc/vmstat); -1 when none of them can be read.
// `proc_root` and `cgroup_root` are "/proc" and "/sys/fs/cgroup" but for
// tests. The launcher compares it before and after a rank is killed by
// SIGKILL to tell an out-of-memory kill from another.
int64_t OomKillCount(const std::string& proc_root = "/proc",
                     const std::string& cgroup_root = "/sys/fs/cgroup");

// The environment variable through which the launcher gives each rank a
// file for its last memory report (one line, rewritten as the run goes; the
// trainer writes its plan and live / peak bytes there), which the launcher
// quotes when the rank is killed for memory.
inline constexpr char kMemoryReportEnv[] = "FSDPP_MEMORY_REPORT";

// The job's identity, the same in every restart and elastic round of one
// launcher (made up when the launcher starts unless its environment already
// has one): the trainer records it in its checkpoints, so that restarted
// ranks resume from this job's latest checkpoint and never adopt an earlier
// run's (torchrun's TORCHELASTIC_RUN_ID plays this part).
inline constexpr char kJobIdEnv[] = "FSDPP_JOB_ID";
// How many times this launcher started its ranks before (0, then 1 after a
// restart or a new elastic round, ...): > 0 tells the ranks to resume.
inline constexpr char kLaunchRoundEnv[] = "FSDPP_LAUNCH_ROUND";

// Cuts a byte stream into lines and puts `prefix` before each. A line longer
// than `max_line_bytes` is emitted in pieces of that size so a child that
// never writes a newline cannot grow the buffer without bound.
//
// Status lines: a line that starts with '\r' is a transient status (e.g. a
// trainer's live progress line). Written to a terminal (`terminal` given),
// it is drawn in place — "\r", prefix, text, erase to the end of the line,
// no newline — and the next ordinary line first erases it. Otherwise it is
// an ordinary line without its '\r'. The launcher tells ranks that their
// status lines reach a terminal with FSDPP_LIVE_STATUS=1 in their
// environment.

// Whether a status line is showing on the terminal (shared by the prefixers
// that write to it).
struct TerminalState {
  bool status_shown = false;
};

class LinePrefixer {
 public:
  // Default cap on the bytes buffered for one unterminated line.
  static constexpr size_t kDefaultMaxLineBytes = 64 * 1024;

  // Prefixes lines with `prefix` (e.g. "[rank 3] "). `terminal` (not owned):
  // the destination is a terminal; see status lines above.
  explicit LinePrefixer(std::string prefix,
                        size_t max_line_bytes = kDefaultMaxLineBytes,
                        TerminalState* terminal = nullptr);

  // Consumes `data` and returns the lines it completes, each prefixed and
  // ending in '\n' (empty if none did).
  std::string Append(absl::string_view data);

  // Returns the buffered unterminated line, prefixed and given a '\n', or ""
  // when nothing is buffered. Used at end of stream.
  std::string Finish();

 private:
  // One complete line (ending in '\n') as it goes out.
  std::string Emit(absl::string_view line);

  std::string prefix_;
  size_t max_line_bytes_;
  TerminalState* terminal_;
  std::string partial_;
};

// Runs the job described by `options` (which must come from a successful
// ParseLaunchArgs without `help`) to completion and returns the launcher's
// exit status (elastic: of the last round, or 1 when the rendezvous failed): 0
// when every rank exited 0; the exit status of the first failing rank (128 +
// signal number if it was killed by a signal); 130 / 143 after SIGINT / SIGTERM
// to the launcher; 1 if a rank could not be started. Installs signal handlers
// and the child-subreaper flag for its duration and restores them on return.
// Call it from a process with no other threads than its own store's (it forks,
// and it reaps every child of the process; the child only makes system calls
// before exec) and not concurrently with itself. Ranks get SIGKILL
// (PR_SET_PDEATHSIG) if the launcher dies without cleaning up.
int RunLaunch(const LaunchOptions& options);

}  // namespace launch
}  // namespace fsdpp

#endif  // FSDPP_RUNTIME_LAUNCH_H_
