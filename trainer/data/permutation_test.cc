// Tests of the counter-based permutation: a bijection for every size,
// deterministic, different per stream and seed.
#include "trainer/data/permutation.h"

#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace trainer {
namespace {

std::vector<uint64_t> Order(uint64_t size, uint64_t seed, uint64_t stream) {
  const Permutation permutation(size, seed, stream);
  std::vector<uint64_t> order(size);
  for (uint64_t i = 0; i < size; ++i) order[i] = permutation(i);
  return order;
}

TEST(PermutationTest, IsABijectionForEverySize) {
  for (uint64_t size = 1; size <= 300; ++size) {
    for (uint64_t seed : {0ull, 1ull, 0xDEADBEEFull}) {
      const std::vector<uint64_t> order = Order(size, seed, size);
      std::vector<bool> seen(size, false);
      for (uint64_t value : order) {
        ASSERT_LT(value, size);
        ASSERT_FALSE(seen[value]) << "size " << size << " seed " << seed;
        seen[value] = true;
      }
    }
  }
}

TEST(PermutationTest, DeterministicAndKeyedBySeedAndStream) {
  EXPECT_EQ(Order(1000, 7, 3), Order(1000, 7, 3));
  EXPECT_NE(Order(1000, 7, 3), Order(1000, 7, 4));
  EXPECT_NE(Order(1000, 7, 3), Order(1000, 8, 3));
  // Shuffled, not the identity or a rotation.
  const std::vector<uint64_t> order = Order(1000, 7, 3);
  int fixed_points = 0;
  for (uint64_t i = 0; i < order.size(); ++i) fixed_points += order[i] == i;
  EXPECT_LT(fixed_points, 10);
}

TEST(PermutationTest, LargeDomainsNeedNoMemory) {
  const uint64_t size = uint64_t{1} << 40;
  const Permutation permutation(size, 42, 0);
  std::set<uint64_t> values;
  for (uint64_t i = 0; i < 10000; ++i) {
    const uint64_t value = permutation(i * 99991);
    EXPECT_LT(value, size);
    values.insert(value);
  }
  EXPECT_EQ(values.size(), 10000u);
}

TEST(PermutationTest, PositionsAreRoughlyUniform) {
  // Where element 0 lands over many streams: each quarter about 1/4.
  constexpr int kStreams = 4000;
  int quarters[4] = {0, 0, 0, 0};
  for (int stream = 0; stream < kStreams; ++stream) {
    ++quarters[Permutation(1000, 5, stream)(0) * 4 / 1000];
  }
  for (int count : quarters) {
    EXPECT_GT(count, kStreams / 4 - 200);
    EXPECT_LT(count, kStreams / 4 + 200);
  }
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
