// Forward + backward of the nn layers at GPT-2-small-like shapes scaled down
// (B = 4, T = 128, C = 256, 4 heads, 4 x C MLP): Linear (C -> 3C, the fused
// qkv projection), LayerNorm, RmsNorm, Mlp and causal self-attention, with
// f32 and bf16 parameters (activations follow the parameters). Each benchmark
// runs one untimed warm-up step so gradient buffers exist and the timed steps
// measure steady state. items_per_second counts tokens (B x T) per
// forward+backward; bytes_per_second the activation bytes read by forward.
//
//   bazel run -c opt //nn:layers_benchmark
#include <cstdint>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/logging.h"
#include "nn/attention.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/mlp.h"
#include "nn/module.h"
#include "nn/rms_norm.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

constexpr int64_t kBatch = 4;
constexpr int64_t kSeq = 128;
constexpr int64_t kDim = 256;
constexpr int64_t kHeads = 4;

DType DTypeArg(const benchmark::State& state) {
  return state.range(0) ? DType::kBF16 : DType::kF32;
}

// Materializes `layer`, then times Forward(x) + Backward(dy) with x of width
// in_dim and dy of width out_dim.
void RunForwardBackward(benchmark::State& state, Module& layer, int64_t in_dim,
                        int64_t out_dim) {
  const DType dtype = DTypeArg(state);
  CHECK_OK(layer.ToEmpty(Device::Cpu()));
  CHECK_OK(layer.InitWeights(1));
  const Tensor x = testing_util::RandomTensor({kBatch, kSeq, in_dim}, dtype, 1);
  const Tensor dy = testing_util::RandomTensor({kBatch, kSeq, out_dim}, dtype,
                                               2, -1e-3f, 1e-3f);
  CHECK_OK(layer.Forward(x).status());  // Warm-up.
  CHECK_OK(layer.Backward(dy).status());
  for (auto _ : state) {
    CHECK_OK(layer.Forward(x).status());
    CHECK_OK(layer.Backward(dy).status());
  }
  state.SetItemsProcessed(state.iterations() * kBatch * kSeq);
  state.SetBytesProcessed(state.iterations() * kBatch * kSeq * in_dim *
                          static_cast<int64_t>(DTypeSize(dtype)));
}

void BM_Linear(benchmark::State& state) {
  Linear layer(kDim, 3 * kDim, /*bias=*/true, 0.02f, DTypeArg(state));
  RunForwardBackward(state, layer, kDim, 3 * kDim);
}

void BM_LayerNorm(benchmark::State& state) {
  LayerNorm layer(kDim, 1e-5f, /*bias=*/true, DTypeArg(state));
  RunForwardBackward(state, layer, kDim, kDim);
}

void BM_RmsNorm(benchmark::State& state) {
  RmsNorm layer(kDim, 1e-6f, DTypeArg(state));
  RunForwardBackward(state, layer, kDim, kDim);
}

void BM_Mlp(benchmark::State& state) {
  Mlp layer(kDim, 4 * kDim, 0.02f, 0.02f, DTypeArg(state));
  RunForwardBackward(state, layer, kDim, kDim);
}

void BM_CausalSelfAttention(benchmark::State& state) {
  AttentionConfig config = AttentionConfig::Gpt2(kDim, kHeads, kSeq);
  config.param_dtype = DTypeArg(state);
  std::unique_ptr<CausalSelfAttention> layer =
      *CausalSelfAttention::Create(config);
  RunForwardBackward(state, *layer, kDim, kDim);
}

// f32 and bf16 parameters, timed in microseconds of wall time (the kernels
// run on a thread pool).
void LayerArgs(benchmark::internal::Benchmark* b) {
  b->Arg(0)
      ->Arg(1)
      ->ArgName("bf16")
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
}

BENCHMARK(BM_Linear)->Apply(LayerArgs);
BENCHMARK(BM_LayerNorm)->Apply(LayerArgs);
BENCHMARK(BM_RmsNorm)->Apply(LayerArgs);
BENCHMARK(BM_Mlp)->Apply(LayerArgs);
BENCHMARK(BM_CausalSelfAttention)->Apply(LayerArgs);

}  // namespace
}  // namespace nn
}  // namespace fsdpp
