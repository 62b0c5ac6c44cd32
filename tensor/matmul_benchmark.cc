// Matmul throughput: our Matmul (validation + primitive cache + oneDNN) next
// to a direct oneDNN call with a prebuilt primitive, in the same binary, at
// 2048^3 and the GPT-2 124M shapes (M = 1024 tokens, K, N in {768, 3072,
// 50304}), f32 and bf16; then a Linear's three calls at those shapes as the
// model makes them (LinearCall). Reports GFLOP/s as the "FLOPS" counter.
//
//   bazel run -c opt //tensor:matmul_benchmark
#include <vector>

#include "benchmark/benchmark.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

Tensor Filled(Shape shape, DType dtype) {
  Tensor t = *Tensor::Empty(std::move(shape), dtype, Device::Cpu());
  CHECK_OK(Fill(&t, 0.01f));
  return t;
}

void SetFlops(benchmark::State& state, int64_t m, int64_t n, int64_t k) {
  state.counters["FLOPS"] = benchmark::Counter(
      2.0 * m * n * k * state.iterations(), benchmark::Counter::kIsRate,
      benchmark::Counter::kIs1000);
}

// Args: M, K, N, dtype (0 = f32, 1 = bf16).
void BM_Matmul(benchmark::State& state) {
  const int64_t m = state.range(0), k = state.range(1), n = state.range(2);
  const DType dtype = state.range(3) ? DType::kBF16 : DType::kF32;
  Tensor a = Filled({m, k}, dtype), b = Filled({k, n}, dtype);
  Tensor c = Filled({m, n}, DType::kF32);
  for (auto _ : state) CHECK_OK(Matmul(a, b, &c));
  SetFlops(state, m, n, k);
}

void BM_DirectOneDnn(benchmark::State& state) {
  const int64_t m = state.range(0), k = state.range(1), n = state.range(2);
  const DType dtype = state.range(3) ? DType::kBF16 : DType::kF32;
  Tensor a = Filled({m, k}, dtype), b = Filled({k, n}, dtype);
  Tensor c = Filled({m, n}, DType::kF32);
  using dt = dnnl::memory::data_type;
  const dt ab = dtype == DType::kBF16 ? dt::bf16 : dt::f32;
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  dnnl::memory::desc a_md({m, k}, ab, dnnl::memory::format_tag::ab);
  dnnl::memory::desc b_md({k, n}, ab, dnnl::memory::format_tag::ab);
  dnnl::memory::desc c_md({m, n}, dt::f32, dnnl::memory::format_tag::ab);
  dnnl::matmul prim(dnnl::matmul::primitive_desc(
      dnnl::matmul::desc(a_md, b_md, c_md), engine));
  dnnl::memory a_mem(a_md, engine, a.raw_data());
  dnnl::memory b_mem(b_md, engine, b.raw_data());
  dnnl::memory c_mem(c_md, engine, c.raw_data());
  for (auto _ : state) {
    prim.execute(stream, {{DNNL_ARG_SRC, a_mem},
                          {DNNL_ARG_WEIGHTS, b_mem},
                          {DNNL_ARG_DST, c_mem}});
    stream.wait();
  }
  SetFlops(state, m, n, k);
}

// A Linear's three calls as the model makes them, with the weight stored
// [N, K]. Args: M, K, N, dtype (0 = f32, 1 = bf16), call (0: y = x W^T,
// 1: dx = dy W, 2: dW += dy^T x into an f32 gradient; a step's first dW
// into a new gradient of x's dtype, 3: zeroed and added to (beta = 1, as
// before nn::GradSink::ForWrite), 4: written (beta = 0, as now)).
void BM_LinearCall(benchmark::State& state) {
  const int64_t m = state.range(0), k = state.range(1), n = state.range(2);
  const DType dtype = state.range(3) ? DType::kBF16 : DType::kF32;
  const int64_t call = state.range(4);
  Tensor x = Filled({m, k}, dtype), w = Filled({n, k}, dtype);
  Tensor dy = Filled({m, n}, dtype);
  Tensor y = Filled({m, n}, dtype), dx = Filled({m, k}, dtype);
  Tensor dw = Filled({n, k}, call >= 3 ? dtype : DType::kF32);
  MatmulOptions options;
  if (call == 0) options.transpose_b = true;
  if (call >= 2) {
    options.transpose_a = true;
    options.beta = call == 4 ? 0.0f : 1.0f;
  }
  for (auto _ : state) {
    if (call == 0) CHECK_OK(Matmul(x, w, &y, options));
    if (call == 1) CHECK_OK(Matmul(dy, w, &dx, options));
    if (call == 3) CHECK_OK(Fill(&dw, 0.0f));
    if (call >= 2) CHECK_OK(Matmul(dy, x, &dw, options));
  }
  SetFlops(state, m, n, k);
}

// Each shape runs ours and the direct call back to back, so machine noise
// hits both alike.
void RegisterPairs() {
  const std::vector<std::vector<int64_t>> shapes = {{2048, 2048, 2048},
                                                    {1024, 768, 768},
                                                    {1024, 768, 3072},
                                                    {1024, 3072, 768},
                                                    {1024, 768, 50304}};
  for (int64_t dtype : {0, 1}) {
    for (const auto& s : shapes) {
      for (auto [name, fn] : {std::pair{"Matmul", &BM_Matmul},
                              std::pair{"DirectOneDnn", &BM_DirectOneDnn}}) {
        benchmark::RegisterBenchmark(name, fn)
            ->Args({s[0], s[1], s[2], dtype})
            ->ArgNames({"M", "K", "N", "bf16"})
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.5)
            ->UseRealTime();
      }
    }
  }
  for (int64_t dtype : {0, 1}) {
    for (const auto& s : shapes) {
      if (s[0] != 1024) continue;
      for (int64_t call : {0, 1, 2, 3, 4}) {
        benchmark::RegisterBenchmark("LinearCall", &BM_LinearCall)
            ->Args({s[0], s[1], s[2], dtype, call})
            ->ArgNames({"M", "K", "N", "bf16", "call"})
            ->Unit(benchmark::kMillisecond)
            ->MinTime(0.5)
            ->UseRealTime();
      }
    }
  }
}

}  // namespace
}  // namespace fsdpp

int main(int argc, char** argv) {
  fsdpp::RegisterPairs();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
