// Throughput of host-side Philox generation (elements per second).
#include <vector>

#include "benchmark/benchmark.h"
#include "core/rng.h"

namespace fsdpp {
namespace {

void BM_FillUniform(benchmark::State& state) {
  std::vector<float> out(state.range(0));
  for (auto _ : state) {
    FillUniform(1, 0, 0, out.size(), 0.0f, 1.0f, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * out.size());
}
BENCHMARK(BM_FillUniform)->Arg(1 << 20)->UseRealTime();

void BM_FillNormal(benchmark::State& state) {
  std::vector<float> out(state.range(0));
  for (auto _ : state) {
    FillNormal(1, 0, 0, out.size(), 0.0f, 1.0f, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * out.size());
}
BENCHMARK(BM_FillNormal)->Arg(1 << 20)->UseRealTime();

}  // namespace
}  // namespace fsdpp
