// Applying the gpt2 family's FSDP plan (ApplyFsdp: one unit per block (12) plus
// the root: wte, wpe, ln_f and the tied head) to GPT-2 124M built on the meta
// device, on a 1-rank mesh (a thread rank over real Gloo): the per-run setup
// cost of sharding the model (grouping parameters into units, laying out the
// Shard(0) masters and gradients, installing hooks). Building the model
// (Transformer::Create) and destroying it are not timed. items_per_second
// counts model parameters sharded.
//
//   bazel run -c opt //models/gpt2:parallelize_benchmark
#include "benchmark/benchmark.h"
#include "models/config.h"
#include "models/gpt2/parallelize.h"
#include "models/testing/plan_benchmark.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {
namespace gpt2 {
namespace {

void BM_ApplyFsdp(benchmark::State& state) {
  testing_util::BenchmarkPlan(
      state, *ConfigByName("gpt2_124m"),
      [](Transformer* model, const FsdpPlanOptions& options) {
        return ApplyFsdp(model, options).status();
      });
}
BENCHMARK(BM_ApplyFsdp)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp
