// Memory-bound op throughput (bytes read + written per second) next to
// memcpy of the same bytes, in the same binary.
//
//   bazel run -c opt //tensor:elementwise_benchmark
#include <cstring>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "tensor/dtype_benchmark.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

constexpr int64_t kElements = 1 << 24;  // 64 MiB of f32: beyond the caches.

Tensor Filled(DType dtype, float value) {
  Tensor t = *Tensor::Empty({kElements}, dtype, Device::Cpu());
  CHECK_OK(Fill(&t, value));
  return t;
}

// Activation inputs spread like a layer's pre-activations (normal, sd 2,
// fixed seed), so that the 16-bit types' table lookups touch the table as a
// model's do rather than one entry.
Tensor Spread(DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> values(kElements);
  for (float& v : values) v = normal(rng);
  return *Tensor::FromFloats({kElements}, values, dtype);
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

// out = op(a, b): three arrays of traffic.
template <class Op>
void Binary(benchmark::State& state, Op op) {
  const DType dtype = DTypeArg(state);
  Tensor a = Filled(dtype, 0.5f), b = Filled(dtype, 2.0f),
         c = Filled(dtype, 0.0f);
  for (auto _ : state) CHECK_OK(op(a, b, &c));
  state.SetBytesProcessed(state.iterations() * 3 * a.nbytes());
}

// out = op(a): two arrays of traffic.
template <class Op>
void Unary(benchmark::State& state, Op op) {
  const DType dtype = DTypeArg(state);
  Tensor a = Filled(dtype, 0.5f), b = Filled(dtype, 0.0f);
  for (auto _ : state) CHECK_OK(op(a, &b));
  state.SetBytesProcessed(state.iterations() * 2 * a.nbytes());
}

// Activations: y = f(x) on spread inputs.
template <class Op>
void Activation(benchmark::State& state, Op op) {
  const DType dtype = DTypeArg(state);
  Tensor a = Spread(dtype, 1), b = Filled(dtype, 0.0f);
  for (auto _ : state) CHECK_OK(op(a, &b));
  state.SetBytesProcessed(state.iterations() * 2 * a.nbytes());
}

void BM_Add(benchmark::State& state) {
  Binary(state, [](const Tensor& a, const Tensor& b, Tensor* c) {
    return Add(a, b, c);
  });
}
FSDPP_BENCHMARK_F32_BF16(BM_Add);

void BM_Mul(benchmark::State& state) {
  Binary(state, [](const Tensor& a, const Tensor& b, Tensor* c) {
    return Mul(a, b, c);
  });
}
FSDPP_BENCHMARK_F32_BF16(BM_Mul);

// y += alpha x: reads x and y, writes y.
void BM_Axpy(benchmark::State& state) {
  Binary(state, [](const Tensor& x, const Tensor&, Tensor* y) {
    return Axpy(1e-3f, x, y);
  });
}
FSDPP_BENCHMARK_F32_BF16(BM_Axpy);

void BM_Scale(benchmark::State& state) {
  Unary(state, [](const Tensor& x, Tensor* y) { return Scale(x, 0.5f, y); });
}
FSDPP_BENCHMARK_F32_BF16(BM_Scale);

void BM_CastF32ToBf16(benchmark::State& state) {
  Tensor a = Filled(DType::kF32, 1.5f), b = Filled(DType::kBF16, 0.0f);
  for (auto _ : state) CHECK_OK(Copy(a, &b));
  state.SetBytesProcessed(state.iterations() * (a.nbytes() + b.nbytes()));
}
BENCHMARK(BM_CastF32ToBf16)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CastBf16ToF32(benchmark::State& state) {
  Tensor a = Filled(DType::kBF16, 1.5f), b = Filled(DType::kF32, 0.0f);
  for (auto _ : state) CHECK_OK(Copy(a, &b));
  state.SetBytesProcessed(state.iterations() * (a.nbytes() + b.nbytes()));
}
BENCHMARK(BM_CastBf16ToF32)->Unit(benchmark::kMillisecond)->UseRealTime();

// dx = f'(x) dy on spread x and dy: reads x and dy, writes dx.
template <class Op>
void ActivationBackward(benchmark::State& state, Op op) {
  const DType dtype = DTypeArg(state);
  Tensor x = Spread(dtype, 1), dy = Spread(dtype, 2), dx = Filled(dtype, 0.0f);
  for (auto _ : state) CHECK_OK(op(x, dy, &dx));
  state.SetBytesProcessed(state.iterations() * 3 * x.nbytes());
}

void BM_Gelu(benchmark::State& state) {
  Activation(state, [](const Tensor& x, Tensor* y) { return Gelu(x, y); });
}
FSDPP_BENCHMARK_F32_BF16(BM_Gelu);

void BM_GeluBackward(benchmark::State& state) {
  ActivationBackward(state, [](const Tensor& x, const Tensor& dy, Tensor* dx) {
    return GeluBackward(x, dy, dx);
  });
}
FSDPP_BENCHMARK_F32_BF16(BM_GeluBackward);

void BM_Silu(benchmark::State& state) {
  Activation(state, [](const Tensor& x, Tensor* y) { return Silu(x, y); });
}
FSDPP_BENCHMARK_F32_BF16(BM_Silu);

void BM_SiluBackward(benchmark::State& state) {
  ActivationBackward(state, [](const Tensor& x, const Tensor& dy, Tensor* dx) {
    return SiluBackward(x, dy, dx);
  });
}
FSDPP_BENCHMARK_F32_BF16(BM_SiluBackward);

}  // namespace
}  // namespace fsdpp
