// Training-step throughput of GPT-2 124M on the CPU: forward + backward of
// one block, and ForwardLoss + Backward of the whole model, at B = 4,
// T = 256, with f32 and bf16 parameters (activations follow the parameters).
//
// GFLOP/s counts the model FLOPs of FlopsPerToken (models/config.h: 6 x
// matmul weights + the full-square attention term), so it is comparable with
// MFU figures; the block's share is the per-layer part (no LM head). Each
// benchmark runs one untimed warm-up step first, so gradient buffers exist
// and the timed steps measure steady state. Iterations take seconds, so the
// defaults run a handful:
//
//   bazel run -c opt //models:transformer_benchmark -- --benchmark_min_time=1
#include <cstdint>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/logging.h"
#include "models/config.h"
#include "models/transformer.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace models {
namespace {

constexpr int64_t kBatch = 4;
constexpr int64_t kSeq = 256;

TransformerConfig Gpt2Config() { return *ConfigByName("gpt2_124m"); }

DType DTypeArg(const benchmark::State& state) {
  return state.range(0) ? DType::kBF16 : DType::kF32;
}

std::unique_ptr<Transformer> Build(DType dtype) {
  TransformerOptions options;
  options.param_dtype = dtype;
  std::unique_ptr<Transformer> model =
      *Transformer::Create(Gpt2Config(), options);
  return model;
}

// Deterministic ids in [0, vocab) of shape [kBatch, kSeq].
Tensor Ids(int64_t vocab, uint64_t seed) {
  std::vector<int64_t> v(kBatch * kSeq);
  uint64_t s = seed;
  for (int64_t& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(vocab));
  }
  return *Tensor::FromInts({kBatch, kSeq}, v, DType::kI64);
}

void SetCounters(benchmark::State& state, double flops_per_step) {
  state.counters["GFLOP"] = benchmark::Counter(
      flops_per_step / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens"] =
      benchmark::Counter(static_cast<double>(kBatch * kSeq),
                         benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Gpt2BlockForwardBackward(benchmark::State& state) {
  const TransformerConfig c = Gpt2Config();
  std::unique_ptr<Transformer> model = Build(DTypeArg(state));
  Module* block = model->blocks()[0];
  CHECK_OK(block->ToEmpty(Device::Cpu()));
  CHECK_OK(block->InitWeights(1));
  const Tensor x =
      testing_util::RandomTensor({kBatch, kSeq, c.dim}, DTypeArg(state), 1);
  const Tensor dy = testing_util::RandomTensor(
      {kBatch, kSeq, c.dim}, DTypeArg(state), 2, -1e-3f, 1e-3f);
  CHECK_OK(block->Forward(x).status());  // Warm-up.
  CHECK_OK(block->Backward(dy).status());
  for (auto _ : state) {
    CHECK_OK(block->Forward(x).status());
    CHECK_OK(block->Backward(dy).status());
  }
  const double block_flops_per_token =
      (FlopsPerToken(c, kSeq) - 6.0 * c.padded_vocab_size() * c.dim) /
      c.n_layers;
  SetCounters(state, block_flops_per_token * kBatch * kSeq);
}
BENCHMARK(BM_Gpt2BlockForwardBackward)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("bf16")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_Gpt2ModelForwardBackward(benchmark::State& state) {
  const TransformerConfig c = Gpt2Config();
  std::unique_ptr<Transformer> model = Build(DTypeArg(state));
  CHECK_OK(model->ToEmpty(Device::Cpu()));
  CHECK_OK(model->InitWeights(1));
  const Tensor ids = Ids(c.vocab_size, 1);
  const Tensor targets = Ids(c.vocab_size, 2);
  CHECK_OK(model->ForwardLoss(ids, targets).status());  // Warm-up.
  CHECK_OK(model->Backward());
  for (auto _ : state) {
    CHECK_OK(model->ForwardLoss(ids, targets).status());
    CHECK_OK(model->Backward());
  }
  SetCounters(state, FlopsPerToken(c, kSeq) * kBatch * kSeq);
}
BENCHMARK(BM_Gpt2ModelForwardBackward)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("bf16")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace models
}  // namespace fsdpp
