// Memory-bound op throughput (bytes read + written per second) next to
// memcpy of the same bytes, in the same binary.
//
//   bazel run -c opt //tensor:elementwise_benchmark
#include <cstring>

#include "benchmark/benchmark.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

constexpr int64_t kElements = 1 << 24;  // 64 MiB of f32: beyond the caches.

Tensor Filled(DType dtype, float value) {
  Tensor t = *Tensor::Empty({kElements}, dtype, Device::Cpu());
  CHECK_OK(Fill(&t, value));
  return t;
}

void BM_Memcpy(benchmark::State& state) {
  Tensor a = Filled(DType::kF32, 1.0f), b = Filled(DType::kF32, 0.0f);
  for (auto _ : state) {
    std::memcpy(b.raw_data(), a.raw_data(), a.nbytes());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * a.nbytes());
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Add(benchmark::State& state) {
  const DType dtype = state.range(0) ? DType::kBF16 : DType::kF32;
  Tensor a = Filled(dtype, 1.0f), b = Filled(dtype, 2.0f),
         c = Filled(dtype, 0.0f);
  for (auto _ : state) CHECK_OK(Add(a, b, &c));
  state.SetBytesProcessed(state.iterations() * 3 * a.nbytes());
}
BENCHMARK(BM_Add)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("bf16")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_Axpy(benchmark::State& state) {
  const DType dtype = state.range(0) ? DType::kBF16 : DType::kF32;
  Tensor x = Filled(dtype, 1.0f), y = Filled(dtype, 2.0f);
  for (auto _ : state) CHECK_OK(Axpy(1e-3f, x, &y));
  state.SetBytesProcessed(state.iterations() * 3 * x.nbytes());
}
BENCHMARK(BM_Axpy)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("bf16")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_CastF32ToBf16(benchmark::State& state) {
  Tensor a = Filled(DType::kF32, 1.5f), b = Filled(DType::kBF16, 0.0f);
  for (auto _ : state) CHECK_OK(Copy(a, &b));
  state.SetBytesProcessed(state.iterations() * (a.nbytes() + b.nbytes()));
}
BENCHMARK(BM_CastF32ToBf16)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Gelu(benchmark::State& state) {
  const DType dtype = state.range(0) ? DType::kBF16 : DType::kF32;
  Tensor a = Filled(dtype, 0.5f), b = Filled(dtype, 0.0f);
  for (auto _ : state) CHECK_OK(Gelu(a, &b));
  state.SetBytesProcessed(state.iterations() * 2 * a.nbytes());
}
BENCHMARK(BM_Gelu)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("bf16")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace fsdpp
