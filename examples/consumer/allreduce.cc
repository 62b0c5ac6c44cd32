// Uses fsdpp's collectives on their own: two ranks (threads of this process)
// connect through an in-memory store over Gloo (loopback TCP), all-reduce a
// vector and check the sums. Exits 0 and prints "allreduce ok" on success.
#include <cstdio>
#include <thread>
#include <vector>

#include "comm/gloo_backend.h"
#include "comm/store.h"

int main() {
  constexpr int kWorld = 2;
  constexpr int kCount = 1024;
  fsdpp::InMemoryStore store;
  std::vector<int> failures(kWorld, 0);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      auto group =
          fsdpp::GlooProcessGroup::Create(&store, rank, kWorld, "consumer");
      if (!group.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank,
                     group.status().ToString().c_str());
        failures[rank] = 1;
        return;
      }
      std::vector<float> values(kCount);
      for (int i = 0; i < kCount; ++i) values[i] = rank * 1000.0f + i;
      fsdpp::Buffer buffer{values.data(), kCount, fsdpp::DType::kF32,
                           fsdpp::Device::Cpu()};
      fsdpp::CollectiveOptions options;
      options.async_op = false;
      auto work = (*group)->AllReduce(buffer, fsdpp::ReduceOp::kSum, options);
      absl::Status status = work.ok() ? (*work)->Wait() : work.status();
      if (!status.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank, status.ToString().c_str());
        failures[rank] = 1;
        return;
      }
      for (int i = 0; i < kCount; ++i) {
        if (values[i] != 1000.0f + 2.0f * i) failures[rank] = 1;
      }
      // Keep the group until the peer is done with it too.
      auto barrier = (*group)->Barrier();
      if (barrier.ok()) (void)(*barrier)->Wait();
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int f : failures) {
    if (f != 0) {
      std::fprintf(stderr, "allreduce failed\n");
      return 1;
    }
  }
  std::printf("allreduce ok: %d ranks, %d floats\n", kWorld, kCount);
  return 0;
}
