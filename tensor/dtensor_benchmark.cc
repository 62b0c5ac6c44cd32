// DTensor::Redistribute of a 1M-element f32 tensor ([1024, 1024] by
// default) on a 1-D mesh {dp: 2} of 2 thread ranks over real Gloo (loopback
// TCP): Shard(0) -> Replicate (an all-gather) and Partial(sum) -> Shard(0)
// (a reduce-scatter), packing included. The mesh and source DTensors are set
// up before timing. Rank 0 runs on the benchmark's thread, rank 1 on a helper
// thread that mirrors each iteration; both meet at a spin barrier after every
// step, so an iteration takes as long as the slower rank. Reports the global
// tensor's bytes per second.
//
//   bazel run -c opt //tensor:dtensor_benchmark
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "comm/lock_step.h"
#include "comm/process_group.h"
#include "comm/store.h"
#include "core/logging.h"
#include "mesh/device_mesh.h"
#include "mesh/lock_step_meshes.h"
#include "tensor/dtensor.h"
#include "tensor/ops.h"
#include "tensor/placement.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kCols = 1024;

// Redistributes a [numel / kCols, kCols] f32 DTensor from `from` to `to` on
// both ranks per iteration. Arg: global element count.
void RunRedistribute(benchmark::State& state, Placement from, Placement to) {
  const int64_t rows = state.range(0) / kCols;
  InMemoryStore store;
  const auto meshes = testing_util::LockStepMeshes({{"dp", kWorld}}, &store);
  DTensor sources[kWorld];
  {
    testing_util::LockStep setup([&](int rank) -> std::shared_ptr<void> {
      const Shape local_shape = {from.is_shard() ? rows / kWorld : rows, kCols};
      absl::StatusOr<Tensor> local =
          Tensor::Empty(local_shape, DType::kF32, Device::Cpu());
      CHECK_OK(local.status());
      CHECK_OK(Fill(&*local, 1.0f + rank));
      auto dt = DTensor::FromLocal(*std::move(local), meshes[rank].get(),
                                   {from}, {rows, kCols});
      CHECK_OK(dt.status());
      sources[rank] = *std::move(dt);
      return nullptr;
    });
    setup.Step();
  }
  {
    testing_util::LockStep ranks([&](int rank) -> std::shared_ptr<void> {
      absl::StatusOr<DTensor> out = sources[rank].Redistribute({to});
      CHECK_OK(out.status());
      benchmark::DoNotOptimize(out->local().raw_data());
      return nullptr;
    });
    for (auto _ : state) ranks.Step();
  }
  state.SetBytesProcessed(state.iterations() * rows * kCols *
                          static_cast<int64_t>(sizeof(float)));
}

void BM_ShardToReplicate(benchmark::State& state) {
  RunRedistribute(state, Placement::Shard(0), Placement::Replicate());
}
BENCHMARK(BM_ShardToReplicate)->Arg(1 << 20)->UseRealTime();

void BM_PartialToShard(benchmark::State& state) {
  RunRedistribute(state, Placement::Partial(ReduceOp::kSum),
                  Placement::Shard(0));
}
BENCHMARK(BM_PartialToShard)->Arg(1 << 20)->UseRealTime();

}  // namespace
}  // namespace fsdpp
