// Loss parallel at GPT-2's vocabulary (V = 50257) on 2 thread ranks over
// real Gloo, in lock step (comm/lock_step.h): 1024 rows per rank,
// forward + backward.
//   BM_LossParallel   LossParallelCrossEntropy on each rank's half of the
//                     vocabulary (its statistics, two all-reduces of 1024
//                     and 2048 floats, the backward of its slice);
//   BM_Gathered       nn::CrossEntropyLoss on each rank's whole [1024, V]
//                     rows: what a gather would leave to compute (the gather
//                     itself, 1024 x V values per rank, not counted).
// items_per_second counts rows over both ranks; f32 and bf16 logits.
//
//   bazel run -c opt //parallel:loss_parallel_benchmark
#include <cstdint>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "comm/lock_step.h"
#include "comm/store.h"
#include "core/logging.h"
#include "mesh/device_mesh.h"
#include "mesh/lock_step_meshes.h"
#include "nn/loss.h"
#include "parallel/loss_parallel.h"
#include "tensor/dtensor.h"
#include "tensor/dtype_benchmark.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace parallel {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kRows = 1024, kVocab = 50257;

Tensor Targets() {
  std::vector<int64_t> t(kRows);
  for (int64_t i = 0; i < kRows; ++i) t[i] = (i * 7919) % kVocab;
  return *Tensor::FromInts({kRows}, t, DType::kI64);
}

// Builds the 2-rank mesh, then runs `step(rank, mesh)` on both ranks once
// per iteration (after one untimed warm-up step).
template <typename Step>
void RunInLockstep(benchmark::State& state, const Step& step) {
  InMemoryStore store;
  const auto meshes = testing_util::LockStepMeshes({{"tp", kWorld}}, &store);
  testing_util::LockStep ranks([&](int rank) -> std::shared_ptr<void> {
    step(rank, *meshes[rank]);
    return nullptr;
  });
  ranks.Step();  // Warm-up, untimed.
  for (auto _ : state) ranks.Step();
  state.SetItemsProcessed(state.iterations() * kRows * kWorld);
}

void BM_LossParallel(benchmark::State& state) {
  const Tensor full =
      testing_util::RandomTensor({kRows, kVocab}, DTypeArg(state), 1, -8, 8);
  const Tensor targets = Targets();
  DTensor logits[kWorld];
  RunInLockstep(state, [&](int rank, DeviceMesh& mesh) {
    if (!logits[rank].local().defined()) {
      logits[rank] = *DTensor::Distribute(full, &mesh, {Placement::Shard(1)});
    }
    LossParallelCrossEntropy loss;
    CHECK_OK(loss.Forward(logits[rank], targets).status());
    CHECK_OK(loss.Backward().status());
  });
}
FSDPP_BENCHMARK_F32_BF16(BM_LossParallel);

void BM_Gathered(benchmark::State& state) {
  const Tensor full =
      testing_util::RandomTensor({kRows, kVocab}, DTypeArg(state), 1, -8, 8);
  const Tensor targets = Targets();
  RunInLockstep(state, [&](int, DeviceMesh&) {
    nn::CrossEntropyLoss loss;
    CHECK_OK(loss.Forward(full, targets).status());
    CHECK_OK(loss.Backward(1.0f).status());
  });
}
FSDPP_BENCHMARK_F32_BF16(BM_Gathered);

}  // namespace
}  // namespace parallel
}  // namespace fsdpp
