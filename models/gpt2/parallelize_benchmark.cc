// Applying the gpt2 family's FSDP plan (ApplyFsdp: one unit per block (12) plus
// the root: wte, wpe, ln_f and the tied head) to GPT-2 124M built on the meta
// device, on a 1-rank mesh (a thread rank over real Gloo): the per-run setup
// cost of sharding the model (grouping parameters into units, laying out the
// Shard(0) masters and gradients, installing hooks). Building the model
// (Transformer::Create) and destroying it are not timed. items_per_second
// counts model parameters sharded.
//
//   bazel run -c opt //models/gpt2:parallelize_benchmark
#include <cstdint>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/logging.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/gpt2/parallelize.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {
namespace gpt2 {
namespace {

void BM_ApplyFsdp(benchmark::State& state) {
  const TransformerConfig config = *ConfigByName("gpt2_124m");
  int64_t parameters = 0;
  testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    for (auto _ : state) {
      state.PauseTiming();
      std::unique_ptr<Transformer> model = *Transformer::Create(config);
      parameters = model->NumParameters();
      state.ResumeTiming();
      CHECK_OK(ApplyFsdp(model.get(), options).status());
      state.PauseTiming();
      model.reset();
      state.ResumeTiming();
    }
  });
  state.SetItemsProcessed(state.iterations() * parameters);
}
BENCHMARK(BM_ApplyFsdp)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp
