// The timing loop of the FSDP-plan benchmarks (models/parallelize,
// models/gpt2, models/llama): applies a plan to a model built on the meta
// device, on a 1-rank mesh (a thread rank over real Gloo). Times the per-run
// setup cost of sharding (grouping parameters into units, laying out the
// Shard(0) masters and gradients, installing hooks); building and destroying
// the model are not timed. items_per_second counts model parameters sharded.
#ifndef FSDPP_MODELS_TESTING_PLAN_BENCHMARK_H_
#define FSDPP_MODELS_TESTING_PLAN_BENCHMARK_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "benchmark/benchmark.h"
#include "core/logging.h"
#include "fsdp/auto_wrap.h"
#include "mesh/device_mesh.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/transformer.h"

namespace fsdpp {
namespace testing_util {

using ApplyPlanFn = std::function<absl::Status(
    models::Transformer* model, const fsdp::FsdpPlanOptions& options)>;

inline void BenchmarkPlan(benchmark::State& state,
                          const models::TransformerConfig& config,
                          const ApplyPlanFn& apply) {
  int64_t parameters = 0;
  RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    fsdp::FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    for (auto _ : state) {
      state.PauseTiming();
      std::unique_ptr<models::Transformer> model =
          *models::Transformer::Create(config);
      parameters = model->NumParameters();
      state.ResumeTiming();
      CHECK_OK(apply(model.get(), options));
      state.PauseTiming();
      model.reset();
      state.ResumeTiming();
    }
  });
  state.SetItemsProcessed(state.iterations() * parameters);
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_MODELS_TESTING_PLAN_BENCHMARK_H_
