// Host-value collectives on three thread ranks over real Gloo: element-wise
// reductions, integer gathers in rank order, strings of different lengths
// (the empty one included) gathered intact.
#include "comm/host_collectives.h"

#include <functional>
#include <string>
#include <vector>

#include "comm/gloo_ranks.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

// fn(rank, group) on `size` thread ranks over real Gloo.
void RunRanks(int size, const std::function<void(int, ProcessGroup*)>& fn) {
  GlooOptions options;
  options.timeout = absl::Seconds(30);
  testing_util::RunGlooRanks(
      size, [&](int rank, GlooProcessGroup& group) { fn(rank, &group); },
      "host", options);
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
