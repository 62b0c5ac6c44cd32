// The launcher library's per-rank setup path: ParseLaunchArgs of a typical
// torchrun-style command line, then RankEnvironment for every local rank of
// the node (over a 40-entry base environment). Reports ranks per second.
//
//   bazel run -c opt //runtime:launch_benchmark
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "runtime/launch.h"

namespace fsdpp {
namespace launch {
namespace {

// A base environment like a login shell's.
std::vector<std::string> BaseEnvironment() {
  std::vector<std::string> env = {"PATH=/usr/local/bin:/usr/bin:/bin",
                                  "HOME=/home/user", "LANG=C.UTF-8",
                                  "TERM=xterm-256color"};
  for (int i = static_cast<int>(env.size()); i < 40; ++i) {
    env.push_back(absl::StrCat("FSDPP_BENCH_VAR_", i, "=value_", i));
  }
  return env;
}

// Arg: ranks per node (nproc_per_node).
void BM_ParseArgsAndRankEnvironments(benchmark::State& state) {
  const int nproc = static_cast<int>(state.range(0));
  const std::vector<std::string> args = {
      absl::StrCat("--nproc_per_node=", nproc),
      "--nnodes=2",
      "--node_rank=1",
      "--master_addr",
      "10.0.0.1",
      "--master_port=29501",
      "--",
      "bazel-bin/trainer/train",
      "--config=gpt2_124m",
      "--steps=100"};
  const std::vector<std::string> base_env = BaseEnvironment();
  for (auto _ : state) {
    absl::StatusOr<LaunchOptions> options = ParseLaunchArgs(args);
    if (!options.ok()) {
      state.SkipWithError(options.status().ToString().c_str());
      break;
    }
    for (int rank = 0; rank < options->nproc_per_node; ++rank) {
      std::vector<std::string> env =
          RankEnvironment(*options, rank, base_env, /*num_cpus=*/64);
      benchmark::DoNotOptimize(env.data());
    }
  }
  state.SetItemsProcessed(state.iterations() * nproc);
}
BENCHMARK(BM_ParseArgsAndRankEnvironments)->Arg(8);

}  // namespace
}  // namespace launch
}  // namespace fsdpp
