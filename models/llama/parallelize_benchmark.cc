// Applying the llama family's FSDP plan (ApplyFsdp: one unit per block plus
// the root: tok_embeddings, norm and the tied output) to a scaled-down Llama
// 3.2 1B (below) built on the meta device, on a 1-rank mesh (a thread rank over
// real Gloo): the per-run setup cost of sharding the model (grouping parameters
// into units, laying out the Shard(0) masters and gradients, installing hooks).
// Building the model (Transformer::Create) and destroying it are not timed.
// items_per_second counts model parameters sharded.
//
//   bazel run -c opt //models/llama:parallelize_benchmark
#include "benchmark/benchmark.h"
#include "models/config.h"
#include "models/llama/parallelize.h"
#include "models/testing/plan_benchmark.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {
namespace llama {
namespace {

// Llama 3.2 1B's widths (dim 2048, 32 heads, 8 kv heads, SwiGLU 8192) with
// 2 of its 16 blocks and a 32768-token vocabulary (189M parameters):
// sharding the full model takes over a minute on a CPU-only machine.
TransformerConfig Llama1bScaledDown() {
  TransformerConfig config = *ConfigByName("llama_1b");
  config.name = "";
  config.n_layers = 2;
  config.vocab_size = 32768;
  return config;
}

void BM_ApplyFsdp(benchmark::State& state) {
  testing_util::BenchmarkPlan(
      state, Llama1bScaledDown(),
      [](Transformer* model, const FsdpPlanOptions& options) {
        return ApplyFsdp(model, options).status();
      });
}
BENCHMARK(BM_ApplyFsdp)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace llama
}  // namespace models
}  // namespace fsdpp
