// The `train` binary.
//
//   bazel run //trainer:train                       # the embedded default run
//   bazel run //trainer:train -- --nproc_per_node=2 --set training.steps=50
//       --config=trainer/configs/gpt2_124m.textproto
//
// Outside a launcher (no RANK / OMPI / SLURM variables) it is its own
// launcher: it validates the config for --nproc_per_node ranks (default 2),
// starts that many copies of itself through tools/launch's library on a
// free local port, and when they all succeed renders the metrics plot
// (tools/plot) and prints where the checkpoint, metrics and plot are. With
// --nproc_per_node=1 it trains in this process instead (and draws a live
// progress line on a terminal), run again under OMP_WAIT_POLICY=ACTIVE on
// the CPU (PASSIVE on a GPU) unless a policy is set. Under a launcher
// (tools/launch, torchrun, mpirun, srun) it is one rank: rendezvous from the
// environment, TCP store, Gloo groups.
//
// Flags (absl flags through core/cli.h: "--name=value" or "--name value";
// --help lists them with their defaults):
//   --config PATH          a text-format TrainConfig (default: the embedded
//                          trainer/configs/default.textproto)
//   --set SECTION.FIELD=V  override a field (repeatable)
//   --nproc_per_node N     local ranks to start when not launched (2)
//   --stop_after_steps N   preemption drill: stop after N steps of this run
//                          as if killed (checkpoints up to then are kept)
//   --profile_steps N      per-op time table over N steps after the warm-up
//                          (metrics.profile_steps)
//   --print_config         print the effective config and exit
//   --help
// Relative paths in the config are relative to the directory the command
// was run from (bazel run's BUILD_WORKING_DIRECTORY).
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint.h"
#include "comm/gloo_backend.h"
#include "comm/rendezvous.h"
#include "comm/store.h"
#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "core/cli.h"
#include "core/gpus.h"
#include "core/logging.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "runtime/launch.h"
#include "trainer/config.h"
#include "trainer/default_config.h"
#include "trainer/trainer.h"

#if defined(FSDPP_WITH_CUDA)
#include "comm/nccl_backend.h"
#endif

ABSL_FLAG(std::string, config, "",
          "a text-format TrainConfig (default: the embedded "
          "trainer/configs/default.textproto)");
ABSL_FLAG(std::vector<std::string>, set, {},
          "SECTION.FIELD=VALUE: override a config field (repeatable)");
ABSL_FLAG(int, nproc_per_node, 2,
          "local ranks to start when not launched by a launcher");
ABSL_FLAG(std::string, nnodes, "1",
          "nodes in the job: run this binary on each with its --node_rank "
          "and the same --master_addr / --master_port (torchrun's static "
          "multi-node launch); MIN:MAX for an elastic job (the ranks restart "
          "at the world size of the nodes there after a failure or when a "
          "node joins, resuming from the latest checkpoint resharded)");
ABSL_FLAG(double, rdzv_last_call_s, 10,
          "elastic: a round closes this long after the last node joined");
ABSL_FLAG(int, node_rank, 0, "this node's index in [0, nnodes)");
ABSL_FLAG(std::string, master_addr, "127.0.0.1",
          "node 0's address, where the rendezvous store listens");
ABSL_FLAG(int, master_port, 0,
          "the rendezvous port; 0 = a free one (one node only)");
ABSL_FLAG(int, max_restarts, 0,
          "after a rank fails, restart this node's ranks up to N times; "
          "they resume from this job's latest checkpoint, whatever "
          "checkpoint.resume says (torchrun's --max_restarts)");
ABSL_FLAG(int64_t, stop_after_steps, 0,
          "preemption drill: stop after N steps of this run as if killed "
          "(checkpoints up to then are kept); 0: off");
ABSL_FLAG(int64_t, profile_steps, 0,
          "print a per-op time table (calls, self time, share of the step) "
          "over N steps after the throughput warm-up; sets "
          "metrics.profile_steps");
ABSL_FLAG(bool, print_config, false, "print the effective config and exit");

namespace fsdpp {
namespace trainer {
namespace {

constexpr char kUsage[] =
    "usage: train [--config PATH] [--set SECTION.FIELD=VALUE ...] "
    "[--nproc_per_node N] [--stop_after_steps N] [--profile_steps N] "
    "[--print_config]\n"
    "  Without --config: the embedded default run (a small GPT-2 on the "
    "embedded corpus).\n"
    "  Not under a launcher: starts --nproc_per_node local ranks (default 2) "
    "of itself.\n";

struct Flags {
  std::string config_path;
  std::vector<std::string> overrides;
  int nproc_per_node = 2;
  int nnodes = 1;
  // Elastic (--nnodes=MIN:MAX): min_nodes >= 1, nnodes = max.
  int min_nodes = 0;
  double rdzv_last_call_s = 10;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 0;
  int max_restarts = 0;
  int64_t stop_after_steps = 0;
  bool print_config = false;
};

// The flags of this command line (core/cli.h; --set is repeatable).
absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  FSDPP_ASSIGN_OR_RETURN(CommandLine line,
                         ParseCommandLineFlags(argc, argv, {"set"}));
  if (line.help) {
    std::fputs(FlagsHelp(kUsage).c_str(), stdout);
    std::exit(0);
  }
  if (!line.positional.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument \"", line.positional[0], "\""));
  }
  Flags flags;
  flags.config_path = absl::GetFlag(FLAGS_config);
  flags.overrides = line.repeated["set"];
  flags.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  launch::LaunchOptions nodes;
  FSDPP_RETURN_IF_ERROR(
      launch::ParseNnodes(absl::GetFlag(FLAGS_nnodes), &nodes));
  flags.nnodes = nodes.nnodes;
  flags.min_nodes = nodes.min_nodes;
  flags.rdzv_last_call_s = absl::GetFlag(FLAGS_rdzv_last_call_s);
  if (!(flags.rdzv_last_call_s >= 0 && flags.rdzv_last_call_s <= 3600)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rdzv_last_call_s must be in [0, 3600], got ",
                     flags.rdzv_last_call_s));
  }
  flags.node_rank = absl::GetFlag(FLAGS_node_rank);
  flags.master_addr = absl::GetFlag(FLAGS_master_addr);
  flags.master_port = absl::GetFlag(FLAGS_master_port);
  flags.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  if (flags.max_restarts < 0 || flags.max_restarts > 1000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_restarts must be in [0, 1000], got ", flags.max_restarts));
  }
  if (flags.nnodes < 1 || flags.node_rank < 0 ||
      flags.node_rank >= flags.nnodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nnodes must be >= 1 and --node_rank in [0, nnodes), got nnodes ",
        flags.nnodes, " node_rank ", flags.node_rank));
  }
  if (flags.master_port < 0 || flags.master_port > 65535 ||
      (flags.nnodes > 1 && flags.master_port == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--master_port must be in [1, 65535] (required with --nnodes > 1), "
        "got ",
        flags.master_port));
  }
  flags.stop_after_steps = absl::GetFlag(FLAGS_stop_after_steps);
  flags.print_config = absl::GetFlag(FLAGS_print_config);
  const int64_t profile_steps = absl::GetFlag(FLAGS_profile_steps);
  if (profile_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--profile_steps must be a non-negative integer, got ", profile_steps));
  }
  if (profile_steps > 0) {
    flags.overrides.push_back(
        absl::StrCat("metrics.profile_steps=", profile_steps));
  }
  if (flags.stop_after_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stop_after_steps must be a non-negative integer, got ",
                     flags.stop_after_steps));
  }
  if (flags.nproc_per_node < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nproc_per_node must be a positive integer, got ",
                     flags.nproc_per_node));
  }
  return flags;
}

// The config the flags describe, paths made absolute.
absl::StatusOr<TrainConfig> LoadConfig(const Flags& flags) {
  TrainConfig config;
  if (flags.config_path.empty()) {
    FSDPP_ASSIGN_OR_RETURN(
        config,
        ParseTrainConfig(DefaultConfigText(), "<embedded default config>"));
  } else {
    std::string path = flags.config_path;
    if (path[0] != '/') path = InvocationDirectory() + "/" + path;
    FSDPP_ASSIGN_OR_RETURN(config, LoadTrainConfig(path));
  }
  FSDPP_RETURN_IF_ERROR(ApplyOverrides(flags.overrides, &config));
  MakePathsAbsolute(InvocationDirectory(), &config);
  return config;
}

// A TCP port that was free a moment ago.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29500;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 29500;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// tools/plot's script in this binary's runfiles, or "".
std::string PlotScript(const char* argv0) {
  for (const std::string& base : {std::string(argv0) + ".runfiles",
                                  std::string("/proc/self/exe.runfiles")}) {
    const std::string p = base + "/fsdpp/tools/plot/plot.py";
    if (PathExists(p)) return p;
  }
  if (const char* dir = std::getenv("RUNFILES_DIR")) {
    const std::string p = std::string(dir) + "/fsdpp/tools/plot/plot.py";
    if (PathExists(p)) return p;
  }
  return "";
}

// Renders the metrics plot; the PNG's path, or "" (with a note) if it could
// not be drawn.
std::string Plot(const char* argv0, const std::string& jsonl) {
  const std::string script = PlotScript(argv0);
  const std::string png =
      (absl::EndsWith(jsonl, ".jsonl") ? jsonl.substr(0, jsonl.size() - 6)
                                       : jsonl) +
      ".png";
  if (script.empty()) {
    std::printf(
        "plot: tools/plot not found in the runfiles; run "
        "`bazel run //tools/plot -- %s`\n",
        jsonl.c_str());
    return "";
  }
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/usr/bin/python3", "python3", script.c_str(), jsonl.c_str(), "--out",
          png.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
      WEXITSTATUS(status) != 0) {
    std::printf("plot: rendering %s failed (see above)\n", jsonl.c_str());
    return "";
  }
  return png;
}

void PrintOutputs(const TrainConfig& config, const std::string& png) {
  std::printf("\nOutputs:\n");
  if (config.checkpoint().interval() > 0) {
    absl::StatusOr<std::string> latest =
        LatestCheckpoint(config.checkpoint().folder());
    std::printf("  checkpoint: %s\n",
                latest.ok() ? latest->c_str() : "(none written)");
  }
  if (!config.metrics().jsonl_path().empty()) {
    std::printf("  metrics:    %s\n", config.metrics().jsonl_path().c_str());
  }
  if (!png.empty()) std::printf("  plot:       %s\n", png.c_str());
  if (config.metrics().trace_steps() > 0) {
    std::printf("  trace:      %s (open in https://ui.perfetto.dev)\n",
                config.metrics().trace_path().c_str());
  }
  std::fflush(stdout);
}

// Installs the caching CPU allocator when the config asks for it (before
// anything is allocated; process-wide, never removed).
void SetUpAllocator(const TrainConfig& config) {
  if (config.training().cpu_caching_allocator()) {
    // For the life of the process, reachable from the registry.
    SetAllocator(new CachingAllocator(CpuRawAllocator()));
  }
}

// Where a rank with `local_rank` computes, and its groups over `store`: the
// CPU and Gloo, or (training.device "cuda") cuda:local_rank, NCCL for the
// mesh and Gloo for the trainer's own host values.
absl::Status SetUpDevice(const TrainConfig& config, int local_rank,
                         Store* store, const GlooOptions& gloo,
                         TrainerEnv* env) {
  if (config.training().device() != "cuda") {
    env->group_factory = GlooGroupFactory(store, gloo);
    return absl::OkStatus();
  }
  FSDPP_RETURN_IF_ERROR(
      Annotate(UseGpu(local_rank), "training.device \"cuda\""));
#if defined(FSDPP_WITH_CUDA)
  env->device = Device::Cuda(local_rank);
  NcclOptions nccl;
  nccl.timeout = gloo.timeout;
  env->group_factory = NcclGroupFactory(store, local_rank, nccl);
  env->host_group_factory = GlooGroupFactory(store, gloo);
#endif
  return absl::OkStatus();
}

// The GPUs a local job of `nproc` ranks needs, checked before anything
// starts: one per rank.
absl::Status CheckGpus(const TrainConfig& config, int nproc) {
  if (config.training().device() != "cuda") return absl::OkStatus();
  if (!BuiltWithCuda()) {
    return absl::FailedPreconditionError(
        "training.device \"cuda\": this binary was built without CUDA; "
        "run it with bazel run --config=cuda //trainer:train");
  }
  if (GpuCount() == 0) {
    return absl::FailedPreconditionError(
        "training.device \"cuda\": this machine shows no GPU (no driver or "
        "device); train on the CPU with training.device \"cpu\"");
  }
  if (GpuCount() < nproc) {
    return absl::FailedPreconditionError(absl::StrCat(
        "training.device \"cuda\": ", nproc,
        " local rank(s) need one GPU each, and this machine shows ", GpuCount(),
        " (lower --nproc_per_node)"));
  }
  return absl::OkStatus();
}

// This rank's training: Trainer::Create, then Run. The trainer (the model,
// its optimizer state, the loaders) is released before this returns.
absl::StatusOr<TrainResult> TrainRank(const TrainConfig& config,
                                      const TrainerEnv& env) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                         Trainer::Create(config, env));
  return trainer->Run();
}

// One rank under a launcher.
int RunRank(const TrainConfig& config, const RendezvousInfo& info,
            int64_t stop_after_steps) {
  SetLogPrefix(absl::StrCat("[rank ", info.rank, "] "));
  SetUpAllocator(config);
  absl::StatusOr<std::unique_ptr<Store>> store =
      StoreFromRendezvous(info, absl::Minutes(2));
  if (!store.ok()) {
    std::fprintf(stderr, "train: rendezvous: %s\n",
                 store.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr,
               "train: rank %d of %d (local %d of %d), rendezvous from %s "
               "%s:%d\n",
               info.rank, info.world_size, info.local_rank,
               info.local_world_size, info.source.c_str(),
               info.master_addr.c_str(), info.master_port);
  GlooOptions gloo;
  gloo.timeout = absl::Seconds(config.comm().timeout_s());
  gloo.shared_memory =
      UsesSharedMemory(config, info.local_world_size, info.world_size);
  absl::StatusOr<std::string> address = ListenAddress(info);
  if (!address.ok()) {
    std::fprintf(stderr, "train: %s\n", address.status().ToString().c_str());
    return 1;
  }
  gloo.hostname = *address;
  TrainerEnv env;
  env.rank = info.rank;
  env.world_size = info.world_size;
  if (absl::Status s =
          SetUpDevice(config, info.local_rank, store->get(), gloo, &env);
      !s.ok()) {
    std::fprintf(stderr, "train: %s\n", s.ToString().c_str());
    return 1;
  }
  env.store = store->get();
  env.out = stdout;
  // tools/launch draws status lines in place when its stdout is a terminal.
  const char* live = std::getenv("FSDPP_LIVE_STATUS");
  if (live != nullptr && std::string(live) == "1") {
    env.progress = TrainerEnv::Progress::kStatusLines;
  }
  env.stop_after_steps = stop_after_steps;
  // The launcher's job identity and whether it started these ranks before
  // (runtime/launch.h): a restarted rank resumes this job's checkpoints.
  if (const char* job = std::getenv(launch::kJobIdEnv)) env.job_id = job;
  for (const char* var :
       {"TORCHELASTIC_RESTART_COUNT", launch::kLaunchRoundEnv}) {
    int count = 0;
    const char* value = std::getenv(var);
    if (value != nullptr && absl::SimpleAtoi(value, &count) && count > 0) {
      env.restarted = true;
    }
  }
  // On failure, report and exit at once, with the trainer still alive: its
  // process groups' and the store's destructors would wait on peers that may
  // be dead or cut off (a heartbeat write to an unreachable store blocks for
  // the store's I/O timeout), turning a clean, named failure into minutes of
  // waiting. The OS closes the sockets.
  const auto fail = [](const absl::Status& status) {
    std::fprintf(stderr, "train: %s\n", status.ToString().c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  };
  absl::StatusOr<std::unique_ptr<Trainer>> trainer =
      Trainer::Create(config, env);
  if (!trainer.ok()) fail(trainer.status());
  absl::StatusOr<TrainResult> result = (*trainer)->Run();
  if (!result.ok()) fail(result.status());
  return 0;
}

// The whole job in this process (one rank).
int RunSingle(const TrainConfig& config, const char* argv0,
              int64_t stop_after_steps) {
  SetUpAllocator(config);
  InMemoryStore store;
  TrainerEnv env;
  GlooOptions gloo;
  gloo.timeout = absl::Seconds(config.comm().timeout_s());
  gloo.shared_memory = UsesSharedMemory(config, 1, 1);
  if (absl::Status s = SetUpDevice(config, 0, &store, gloo, &env); !s.ok()) {
    std::fprintf(stderr, "train: %s\n", s.ToString().c_str());
    return 1;
  }
  env.store = &store;
  env.progress = isatty(fileno(stdout)) ? TrainerEnv::Progress::kTerminal
                                        : TrainerEnv::Progress::kLines;
  env.stop_after_steps = stop_after_steps;
  absl::StatusOr<TrainResult> result = TrainRank(config, env);
  if (!result.ok()) {
    std::fprintf(stderr, "train: %s\n", result.status().ToString().c_str());
    return 1;
  }
  std::string png;
  if (!config.metrics().jsonl_path().empty()) {
    png = Plot(argv0, config.metrics().jsonl_path());
  }
  PrintOutputs(config, png);
  return 0;
}

// The OpenMP wait policy of a rank that trains in this process. On the CPU
// its pool has the cores to itself, and workers that spin between parallel
// regions (ACTIVE) took 6-11% off GPT-2's step on 2 cores against libgomp's
// default of a short spin then sleep (medians, docs/PERFORMANCE.md); on a
// GPU the host pool is idle most of the time and sleeps (PASSIVE).
const char* InProcessWaitPolicy(const TrainConfig& config) {
  return config.training().device() == "cuda" ? "PASSIVE" : "ACTIVE";
}

// libgomp reads OMP_WAIT_POLICY once, as it loads: to train in this process
// under `policy` the binary runs itself again with it set. A policy the
// user set is kept. Returns when it did not run itself again.
void RerunWithWaitPolicy(const char* policy, char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", policy, /*overwrite=*/1);
  execv("/proc/self/exe", argv);
  const int error = errno;
  unsetenv("OMP_WAIT_POLICY");
  std::fprintf(stderr,
               "train: could not run itself again with OMP_WAIT_POLICY=%s "
               "(%s); training with OpenMP's default wait policy\n",
               policy, std::strerror(error));
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "train: %s\n%s", flags.status().message().data(),
                 kUsage);
    return 2;
  }
  absl::StatusOr<TrainConfig> config = LoadConfig(*flags);
  if (!config.ok()) {
    std::fprintf(stderr, "train: %s\n", config.status().ToString().c_str());
    return 2;
  }
  if (flags->print_config) {
    std::fputs(FormatTrainConfig(*config).c_str(), stdout);
    return 0;
  }
  absl::StatusOr<RendezvousInfo> info = RendezvousFromEnv();
  if (info.ok()) return RunRank(*config, *info, flags->stop_after_steps);
  if (!absl::IsNotFound(info.status())) {
    std::fprintf(stderr, "train: %s\n", info.status().ToString().c_str());
    return 2;
  }
  // Not launched: validate for the local job, then start it.
  const int nproc = flags->nproc_per_node;
  const int world = nproc * flags->nnodes;
  const bool in_process = world == 1 && flags->min_nodes == 0;
  // Before the checks, so that they (and CheckGpus' probe) run once.
  if (in_process) RerunWithWaitPolicy(InProcessWaitPolicy(*config), argv);
  // Elastic: every world size the job may run at.
  for (int nodes = flags->min_nodes > 0 ? flags->min_nodes : flags->nnodes;
       nodes <= flags->nnodes; ++nodes) {
    if (absl::Status s = Validate(*config, nproc * nodes); !s.ok()) {
      std::fprintf(stderr,
                   "train: %s (for %d rank(s): --nproc_per_node=%d x "
                   "%d node(s))\n",
                   s.ToString().c_str(), nproc * nodes, nproc, nodes);
      return 2;
    }
  }
  if (absl::Status s = CheckGpus(*config, nproc); !s.ok()) {
    std::fprintf(stderr, "train: %s\n", s.ToString().c_str());
    return 2;
  }
  if (in_process) {
    return RunSingle(*config, argv[0], flags->stop_after_steps);
  }
  // Launched ranks share the host's cores with each other's comm threads:
  // their OpenMP workers sleep between parallel regions.
  setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/0);
  launch::LaunchOptions launch_options;
  launch_options.nproc_per_node = nproc;
  launch_options.nnodes = flags->nnodes;
  if (flags->min_nodes > 0) {
    launch_options.min_nodes = flags->min_nodes;
    launch_options.max_nodes = flags->nnodes;
    launch_options.rdzv_last_call_s = flags->rdzv_last_call_s;
  }
  launch_options.node_rank = flags->node_rank;
  launch_options.master_addr = flags->master_addr;
  launch_options.master_port =
      flags->master_port > 0 ? flags->master_port : FreePort();
  launch_options.max_restarts = flags->max_restarts;
  // The children are this binary with the same flags (they see RANK).
  launch_options.program.push_back("/proc/self/exe");
  for (int i = 1; i < argc; ++i) launch_options.program.push_back(argv[i]);
  std::printf("train: starting %d local ranks (tools/launch, port %d)\n", nproc,
              launch_options.master_port);
  std::fflush(stdout);
  const int rc = launch::RunLaunch(launch_options);
  if (rc != 0) return rc;
  if (flags->node_rank != 0) return 0;  // rank 0's outputs are on node 0
  std::string png;
  if (!config->metrics().jsonl_path().empty()) {
    png = Plot(argv[0], config->metrics().jsonl_path());
  }
  PrintOutputs(*config, png);
  return 0;
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp

int main(int argc, char** argv) { return fsdpp::trainer::Main(argc, argv); }
