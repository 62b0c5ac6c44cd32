// ApplyBlockPlan — the plan every model family's ApplyFsdp runs: one FSDP
// unit per transformer block, then the root — on models built on the meta
// device (GPT-2 124M, full size: 12 blocks; Llama 3.2 1B's widths scaled
// down to 2 blocks, below), on a 1-rank mesh (a thread rank over real Gloo).
// Times the per-run setup cost of sharding (grouping parameters into units,
// laying out the Shard(0) masters and gradients, installing hooks); building
// and destroying the model are not timed. items_per_second counts model
// parameters sharded.
//
//   bazel run -c opt //models/parallelize:block_plan_benchmark
#include "benchmark/benchmark.h"
#include "fsdp/auto_wrap.h"
#include "models/config.h"
#include "models/parallelize/block_plan.h"
#include "models/testing/plan_benchmark.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {
namespace {

void ApplyBlockPlanTo(benchmark::State& state,
                      const TransformerConfig& config) {
  testing_util::BenchmarkPlan(
      state, config,
      [&](Transformer* model, const fsdp::FsdpPlanOptions& options) {
        return ApplyBlockPlan(model, config.family, "benchmark", options)
            .status();
      });
}

void BM_ApplyBlockPlanGpt2_124m(benchmark::State& state) {
  ApplyBlockPlanTo(state, *ConfigByName("gpt2_124m"));
}
BENCHMARK(BM_ApplyBlockPlanGpt2_124m)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Llama 3.2 1B's widths with 2 of its 16 blocks and a 32768-token vocabulary
// (189M parameters): sharding the full model takes over a minute on a
// CPU-only machine.
void BM_ApplyBlockPlanLlama_1bScaledDown(benchmark::State& state) {
  TransformerConfig config = *ConfigByName("llama_1b");
  config.name = "";
  config.n_layers = 2;
  config.vocab_size = 32768;
  ApplyBlockPlanTo(state, config);
}
BENCHMARK(BM_ApplyBlockPlanLlama_1bScaledDown)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace models
}  // namespace fsdpp
