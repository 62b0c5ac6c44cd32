// FullyShard on a stack of nn layers (4 pre-norm blocks: LayerNorm,
// causal self-attention, LayerNorm, Mlp, at C = 256, 4 heads, then a final
// LayerNorm; 3.2M parameters), one unit per block plus the root, on 2 thread
// ranks over real Gloo (loopback TCP). Measured per iteration, both ranks
// running the same steps in lock step (comm/lock_step.h):
//   BM_UnshardReshard    Unshard (the all-gather, copy-in and copy-out) then
//                        Reshard of every unit: bytes_per_second counts the
//                        unsharded parameter bytes gathered;
//   BM_ForwardBackward   forward + backward of the sharded stack on a local
//                        batch of 2 x 128 tokens per rank (all-gathers,
//                        prefetching, reduce-scatters): items_per_second
//                        counts tokens over both ranks.
// Both run with f32 and bf16 parameter (all-gather and compute) dtype.
//
//   bazel run -c opt //fsdp:fully_shard_benchmark
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "comm/lock_step.h"
#include "comm/store.h"
#include "core/dtype.h"
#include "core/logging.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "mesh/lock_step_meshes.h"
#include "nn/attention.h"
#include "nn/block.h"
#include "nn/layer_norm.h"
#include "nn/mlp.h"
#include "nn/module.h"
#include "nn/sequential.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace fsdp {
namespace {

constexpr int kWorld = 2;
constexpr int kBlocks = 4;
constexpr int64_t kLocalBatch = 2;
constexpr int64_t kSeq = 128;
constexpr int64_t kDim = 256;
constexpr int64_t kHeads = 4;

// The stack, sharded: one unit per block, then the root (the final norm).
struct ShardedStack {
  std::unique_ptr<nn::Sequential> model;
  std::vector<FsdpUnit*> units;
};

ShardedStack BuildSharded(DeviceMesh& mesh, DType param_dtype) {
  ShardedStack s;
  s.model = std::make_unique<nn::Sequential>();
  std::vector<Module*> blocks;
  for (int i = 0; i < kBlocks; ++i) {
    blocks.push_back(s.model->Append(std::make_unique<nn::Block>(
        std::make_unique<nn::LayerNorm>(kDim),
        *nn::CausalSelfAttention::Create(
            nn::AttentionConfig::Gpt2(kDim, kHeads, kSeq)),
        std::make_unique<nn::LayerNorm>(kDim),
        std::make_unique<nn::Mlp>(kDim, 4 * kDim))));
  }
  s.model->Append(std::make_unique<nn::LayerNorm>(kDim));
  FullyShardOptions options;
  options.mesh = &mesh;
  options.mp_policy.param_dtype = param_dtype;
  for (Module* block : blocks) {
    s.units.push_back(*FullyShard({block}, options));
  }
  s.units.push_back(*FullyShard({s.model.get()}, options));
  CHECK_OK(InitShardedWeights(s.model.get(), 1));
  return s;
}

DType DTypeArg(const benchmark::State& state) {
  return state.range(0) ? DType::kBF16 : DType::kF32;
}

// A [kLocalBatch, kSeq, kDim] tensor of values in [-scale, scale).
Tensor Activations(DType dtype, float scale, uint64_t seed) {
  return testing_util::RandomTensor({kLocalBatch, kSeq, kDim}, dtype, seed,
                                    -scale, scale);
}

// Runs `step` on both ranks (testing_util::LockStep: rank 0 on the
// benchmark's thread, rank 1 on a helper) once per iteration of the benchmark
// loop, after one untimed warm-up step that records the order and allocates
// the gradients. `step` gets the rank's stack and rank.
template <typename Step>
void RunInLockstep(benchmark::State& state, const Step& step) {
  InMemoryStore store;
  const auto meshes = testing_util::LockStepMeshes({{"dp", kWorld}}, &store);
  ShardedStack stacks[kWorld];  // Destroyed before the meshes.
  {
    testing_util::LockStep setup([&](int rank) -> std::shared_ptr<void> {
      stacks[rank] = BuildSharded(*meshes[rank], DTypeArg(state));
      step(stacks[rank], rank);
      return nullptr;
    });
    setup.Step();
  }
  testing_util::LockStep ranks([&](int rank) -> std::shared_ptr<void> {
    step(stacks[rank], rank);
    return nullptr;
  });
  for (auto _ : state) ranks.Step();
}

void BM_UnshardReshard(benchmark::State& state) {
  int64_t unsharded_bytes = 0;
  RunInLockstep(state, [&](ShardedStack& stack, int rank) {
    int64_t bytes = 0;
    for (FsdpUnit* unit : stack.units) {
      CHECK_OK(unit->Unshard());
      for (ShardedParameter& p : unit->parameters()) {
        bytes += static_cast<int64_t>(p.parameter->data.nbytes());
      }
      CHECK_OK(unit->Reshard());
    }
    if (rank == 0) unsharded_bytes = bytes;
  });
  state.SetBytesProcessed(state.iterations() * unsharded_bytes);
}
BENCHMARK(BM_UnshardReshard)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("bf16")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_ForwardBackward(benchmark::State& state) {
  const DType dtype = DTypeArg(state);
  const Tensor x[kWorld] = {Activations(dtype, 1.0f, 0),
                            Activations(dtype, 1.0f, 1)};
  const Tensor dy[kWorld] = {Activations(dtype, 1e-3f, 2),
                             Activations(dtype, 1e-3f, 3)};
  RunInLockstep(state, [&](ShardedStack& stack, int rank) {
    CHECK_OK(stack.model->Forward(x[rank]).status());
    CHECK_OK(stack.model->Backward(dy[rank]).status());
  });
  state.SetItemsProcessed(state.iterations() * kWorld * kLocalBatch * kSeq);
}
BENCHMARK(BM_ForwardBackward)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("bf16")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace fsdp
}  // namespace fsdpp
