// Benchmarks run over f32 and bf16: the argument convention shared by the
// tensor benchmarks (elementwise, rowwise).
#ifndef FSDPP_TENSOR_DTYPE_BENCHMARK_H_
#define FSDPP_TENSOR_DTYPE_BENCHMARK_H_

#include "benchmark/benchmark.h"
#include "core/dtype.h"

namespace fsdpp {

// The dtype of a benchmark registered with FSDPP_BENCHMARK_F32_BF16.
inline DType DTypeArg(const benchmark::State& state) {
  return state.range(0) ? DType::kBF16 : DType::kF32;
}

}  // namespace fsdpp

// Registers a benchmark over f32 (bf16:0) and bf16 (bf16:1), in ms of wall
// time.
#define FSDPP_BENCHMARK_F32_BF16(fn)  \
  BENCHMARK(fn)                       \
      ->Arg(0)                        \
      ->Arg(1)                        \
      ->ArgName("bf16")               \
      ->Unit(benchmark::kMillisecond) \
      ->UseRealTime()

#endif  // FSDPP_TENSOR_DTYPE_BENCHMARK_H_
