// Host-value collectives on three thread ranks over real Gloo: element-wise
// reductions, integer gathers in rank order, strings of different lengths
// (the empty one included) gathered intact.
#include "comm/host_collectives.h"

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

// fn(rank, group) on `size` thread ranks; no rank closes its group before
// every rank is done.
void RunRanks(int size, const std::function<void(int, ProcessGroup*)>& fn) {
  InMemoryStore store;
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions options;
      options.timeout = absl::Seconds(30);
      auto group = GlooProcessGroup::Create(&store, r, size, "host", options);
      if (group.ok()) {
        fn(r, group->get());
      } else {
        ADD_FAILURE() << group.status();
      }
      std::unique_lock<std::mutex> lock(mu);
      ++done;
      cv.notify_all();
      cv.wait(lock, [&] { return done == size; });
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(HostCollectivesTest, AllReduceValuesElementWise) {
  RunRanks(3, [](int rank, ProcessGroup* group) {
    std::vector<double> sum = {1.0 + rank, -2.0 * rank};
    ASSERT_TRUE(AllReduceValues(group, &sum, ReduceOp::kSum).ok());
    EXPECT_EQ(sum, (std::vector<double>{6.0, -6.0}));
    std::vector<double> max = {static_cast<double>(rank), -1.0 * rank};
    ASSERT_TRUE(AllReduceValues(group, &max, ReduceOp::kMax).ok());
    EXPECT_EQ(max, (std::vector<double>{2.0, 0.0}));
    std::vector<double> avg = {3.0 * rank};
    ASSERT_TRUE(AllReduceValues(group, &avg, ReduceOp::kAvg).ok());
    EXPECT_EQ(avg, (std::vector<double>{3.0}));
  });
}

TEST(HostCollectivesTest, AllGatherIntsInRankOrder) {
  RunRanks(3, [](int rank, ProcessGroup* group) {
    absl::StatusOr<std::vector<int64_t>> all =
        AllGatherInts(group, {rank, int64_t{1} << (40 + rank)});
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(*all,
              (std::vector<int64_t>{0, int64_t{1} << 40, 1, int64_t{1} << 41, 2,
                                    int64_t{1} << 42}));
  });
}

TEST(HostCollectivesTest, AllGatherStringsOfAnyLength) {
  const std::vector<std::string> strings = {"", std::string("a\0b", 3),
                                            "a longer string"};
  RunRanks(3, [&](int rank, ProcessGroup* group) {
    absl::StatusOr<std::vector<std::string>> all =
        AllGatherStrings(group, strings[rank]);
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(*all, strings);
  });
}

}  // namespace
}  // namespace fsdpp
