// Blocking Gloo collectives (all_reduce sum, all_gather, reduce_scatter sum)
// of f32 buffers between 2 thread ranks of this process over real Gloo
// (loopback TCP), at 64 KiB and 4 MiB per rank. Rank 0 runs on the
// benchmark's thread, rank 1 on a helper thread that mirrors each iteration;
// both meet at a spin barrier after every op, so an iteration takes as long
// as the slower rank. Groups are set up outside the timed loop. Reports the
// per-rank buffer bytes per second (algorithm bandwidth, as nccl-tests).
//
//   bazel run -c opt //comm:collectives_benchmark
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "comm/gloo_backend.h"
#include "comm/lock_step.h"
#include "comm/process_group.h"
#include "comm/store.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/logging.h"

namespace fsdpp {
namespace {

constexpr int kWorld = 2;

// Both ranks' groups of one 2-rank Gloo world, connected concurrently.
struct TwoRankGroups {
  TwoRankGroups() {
    GlooOptions options;
    options.timeout = absl::Seconds(60);
    std::thread peer([&] {
      auto g = GlooProcessGroup::Create(&store, 1, kWorld, "bench", options);
      CHECK_OK(g.status());
      groups[1] = *std::move(g);
    });
    auto g = GlooProcessGroup::Create(&store, 0, kWorld, "bench", options);
    CHECK_OK(g.status());
    groups[0] = *std::move(g);
    peer.join();
  }
  InMemoryStore store;
  std::unique_ptr<GlooProcessGroup> groups[kWorld];
};

CollectiveOptions Blocking() {
  CollectiveOptions options;
  options.async_op = false;
  return options;
}

Buffer F32(std::vector<float>& v) {
  return Buffer{v.data(), static_cast<int64_t>(v.size()), DType::kF32,
                Device::Cpu()};
}

// Runs `op(rank, group)` in lock step on both ranks for every iteration.
void RunCollective(
    benchmark::State& state,
    const std::function<absl::Status(int, GlooProcessGroup&)>& op) {
  TwoRankGroups world;
  testing_util::LockStep ranks([&](int rank) -> std::shared_ptr<void> {
    CHECK_OK(op(rank, *world.groups[rank]));
    return nullptr;
  });
  for (auto _ : state) ranks.Step();
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

// Arg: bytes per rank (the buffer reduced in place).
void BM_AllReduce(benchmark::State& state) {
  const int64_t count = state.range(0) / sizeof(float);
  std::vector<float> buffers[kWorld] = {std::vector<float>(count, 1.0f),
                                        std::vector<float>(count, 2.0f)};
  RunCollective(state, [&](int rank, GlooProcessGroup& group) {
    auto work = group.AllReduce(F32(buffers[rank]), ReduceOp::kSum, Blocking());
    return work.ok() ? (*work)->Wait() : work.status();
  });
}
BENCHMARK(BM_AllReduce)->Arg(64 << 10)->Arg(4 << 20)->UseRealTime();

// Arg: bytes per rank of the input (the output is kWorld times larger).
void BM_AllGather(benchmark::State& state) {
  const int64_t count = state.range(0) / sizeof(float);
  std::vector<float> inputs[kWorld] = {std::vector<float>(count, 1.0f),
                                       std::vector<float>(count, 2.0f)};
  std::vector<float> outputs[kWorld] = {std::vector<float>(count * kWorld),
                                        std::vector<float>(count * kWorld)};
  RunCollective(state, [&](int rank, GlooProcessGroup& group) {
    auto work =
        group.AllGather(F32(inputs[rank]), F32(outputs[rank]), Blocking());
    return work.ok() ? (*work)->Wait() : work.status();
  });
}
BENCHMARK(BM_AllGather)->Arg(64 << 10)->Arg(4 << 20)->UseRealTime();

// Arg: bytes per rank of the input (each rank keeps 1 / kWorld of it).
void BM_ReduceScatter(benchmark::State& state) {
  const int64_t count = state.range(0) / sizeof(float);
  std::vector<float> inputs[kWorld] = {std::vector<float>(count, 1.0f),
                                       std::vector<float>(count, 2.0f)};
  std::vector<float> outputs[kWorld] = {
      std::vector<float>(ReduceScatterCount(count, kWorld, 0)),
      std::vector<float>(ReduceScatterCount(count, kWorld, 1))};
  RunCollective(state, [&](int rank, GlooProcessGroup& group) {
    auto work = group.ReduceScatter(F32(inputs[rank]), F32(outputs[rank]),
                                    ReduceOp::kSum, Blocking());
    return work.ok() ? (*work)->Wait() : work.status();
  });
}
BENCHMARK(BM_ReduceScatter)->Arg(64 << 10)->Arg(4 << 20)->UseRealTime();

}  // namespace
}  // namespace fsdpp
