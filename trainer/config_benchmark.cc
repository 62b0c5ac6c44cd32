// The per-run config path of the trainer on the shipped default config
// (trainer/configs/default.textproto, compiled in as DefaultConfigText()):
//   BM_ParseDefaultConfig    ParseTrainConfig of the text;
//   BM_ResolveDefaultConfig  ResolveTrainConfig (validation and the derived
//                            sizes) of the parsed config at world size 2, the
//                            size it is written for;
//   BM_FormatDefaultConfig   FormatTrainConfig (what the trainer logs and
//                            saves beside its checkpoints).
// bytes_per_second counts the config text's bytes.
//
//   bazel run -c opt //trainer:config_benchmark
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "benchmark/benchmark.h"
#include "core/logging.h"
#include "trainer/config.h"
#include "trainer/default_config.h"

namespace fsdpp {
namespace trainer {
namespace {

constexpr int kWorldSize = 2;

void SetTextBytes(benchmark::State& state) {
  state.SetBytesProcessed(state.iterations() *
                          static_cast<int64_t>(DefaultConfigText().size()));
}

TrainConfig DefaultConfig() {
  return *ParseTrainConfig(DefaultConfigText(), "default.textproto");
}

void BM_ParseDefaultConfig(benchmark::State& state) {
  const absl::string_view text = DefaultConfigText();
  for (auto _ : state) {
    absl::StatusOr<TrainConfig> config =
        ParseTrainConfig(text, "default.textproto");
    CHECK_OK(config.status());
    benchmark::DoNotOptimize(config);
  }
  SetTextBytes(state);
}
BENCHMARK(BM_ParseDefaultConfig);

void BM_ResolveDefaultConfig(benchmark::State& state) {
  const TrainConfig config = DefaultConfig();
  for (auto _ : state) {
    absl::StatusOr<ResolvedTrainConfig> resolved =
        ResolveTrainConfig(config, kWorldSize);
    CHECK_OK(resolved.status());
    benchmark::DoNotOptimize(resolved);
  }
  SetTextBytes(state);
}
BENCHMARK(BM_ResolveDefaultConfig);

void BM_FormatDefaultConfig(benchmark::State& state) {
  const TrainConfig config = DefaultConfig();
  for (auto _ : state) {
    std::string text = FormatTrainConfig(config);
    benchmark::DoNotOptimize(text);
  }
  SetTextBytes(state);
}
BENCHMARK(BM_FormatDefaultConfig);

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
