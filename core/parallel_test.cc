#include "core/parallel.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

// The ranges chunk() was called with, sorted by begin.
std::vector<std::pair<int64_t, int64_t>> Ranges(int64_t n) {
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  ParallelChunks(n, [&](int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(mu);
    ranges.emplace_back(begin, end);
  });
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

TEST(ParallelChunksTest, SmallLoopsRunOnceOnTheCallingThread) {
  EXPECT_TRUE(Ranges(0).empty());
  EXPECT_EQ(Ranges(1), (std::vector<std::pair<int64_t, int64_t>>{{0, 1}}));
  EXPECT_EQ(Ranges(kParallelElements),
            (std::vector<std::pair<int64_t, int64_t>>{{0, kParallelElements}}));
}

TEST(ParallelChunksTest, LargeLoopsAreCoveredOnceInCacheLineAlignedPieces) {
  for (int threads : {1, 2, 3, 7}) {
    omp_set_num_threads(threads);
    for (int64_t n :
         {kParallelElements + 1, int64_t{100003}, int64_t{1} << 20}) {
      const auto ranges = Ranges(n);
      ASSERT_FALSE(ranges.empty());
      EXPECT_LE(static_cast<int>(ranges.size()), threads);
      int64_t next = 0;
      for (const auto& [begin, end] : ranges) {
        EXPECT_EQ(begin, next) << "threads " << threads << " n " << n;
        EXPECT_EQ(begin % 64, 0);
        EXPECT_LT(begin, end);
        next = end;
      }
      EXPECT_EQ(next, n) << "threads " << threads;
    }
  }
}

// The affinity mask's CPU count: shrinking the mask shrinks it.
TEST(AvailableCpusTest, FollowsTheAffinityMask) {
  cpu_set_t original;
  ASSERT_EQ(sched_getaffinity(0, sizeof(original), &original), 0);
  EXPECT_EQ(AvailableCpus(), CPU_COUNT(&original));
  int first = 0;
  while (!CPU_ISSET(first, &original)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(AvailableCpus(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(original), &original), 0);
}

}  // namespace
}  // namespace fsdpp
