// Chunk arithmetic, nested sharding boxes and CopyBox against plain loops.
#include "tensor/sharding.h"

#include "gtest/gtest.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

TEST(ShardingTest, ChunkSemantics) {
  // 10 split 4 ways: chunk 3 -> [0,3) [3,6) [6,9) [9,10).
  EXPECT_EQ(ChunkSize(10, 4), 3);
  const int64_t begins[] = {0, 3, 6, 9}, lengths[] = {3, 3, 3, 1};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(ChunkRange(10, 4, r).begin, begins[r]);
    EXPECT_EQ(ChunkRange(10, 4, r).length, lengths[r]);
  }
  // 5 split 4 ways: chunk 2 -> [0,2) [2,4) [4,5) [5,5) (empty).
  EXPECT_EQ(ChunkRange(5, 4, 3).length, 0);
  EXPECT_EQ(ChunkRange(5, 4, 3).begin, 5);
  EXPECT_EQ(ChunkRange(0, 3, 1).length, 0);
  // Pieces tile [0, n) for many n, k.
  for (int64_t n = 0; n < 40; ++n) {
    for (int k = 1; k <= 7; ++k) {
      int64_t next = 0;
      for (int r = 0; r < k; ++r) {
        const Range range = ChunkRange(n, k, r);
        ASSERT_EQ(range.begin, next);
        ASSERT_GE(range.length, 0);
        next += range.length;
      }
      ASSERT_EQ(next, n);
    }
  }
}

TEST(ShardingTest, LocalBoxNestsAxesInMeshOrder) {
  // Dim 0 of 10 sharded by axis 0 (2 ways) then axis 1 (3 ways):
  // axis 0 -> [0,5) [5,10); each split 3 ways -> chunk 2.
  const Shape global = {10, 4};
  const std::vector<Placement> p = {Placement::Shard(0), Placement::Shard(0)};
  Box b = LocalBox(global, {2, 3}, {1, 2}, p);
  EXPECT_EQ(b.offset, (Shape{9, 0}));
  EXPECT_EQ(b.shape, (Shape{1, 4}));
  b = LocalBox(global, {2, 3}, {0, 1}, p);
  EXPECT_EQ(b.offset, (Shape{2, 0}));
  EXPECT_EQ(b.shape, (Shape{2, 4}));
  // Different dims on different axes; Replicate and Partial keep the extent.
  b = LocalBox(global, {2, 3}, {1, 1},
               {Placement::Shard(1), Placement::Shard(0)});
  EXPECT_EQ(b.offset, (Shape{4, 2}));
  EXPECT_EQ(b.shape, (Shape{4, 2}));
  b = LocalBox(global, {2, 3}, {1, 1},
               {Placement::Partial(), Placement::Replicate()});
  EXPECT_EQ(b.offset, (Shape{0, 0}));
  EXPECT_EQ(b.shape, global);
}

TEST(ShardingTest, CopyBoxMatchesLoops) {
  Tensor src = testing_util::RandomTensor({5, 6, 7}, DType::kF32, 1);
  Tensor dst = *Tensor::Zeros({4, 8, 7}, DType::kF32, Device::Cpu());
  const Shape so = {1, 2, 0}, doff = {0, 3, 0}, box = {3, 4, 7};
  ASSERT_TRUE(CopyBox(src, so, &dst, doff, box).ok());
  const float* s = src.data<float>();
  const float* d = dst.data<float>();
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 8; ++j) {
      for (int k = 0; k < 7; ++k) {
        const bool inside = i < 3 && j >= 3 && j < 7;
        const float expected =
            inside ? s[((i + 1) * 6 + (j - 3 + 2)) * 7 + k] : 0.0f;
        ASSERT_EQ(d[(i * 8 + j) * 7 + k], expected)
            << i << " " << j << " " << k;
      }
    }
  }
  // Partial innermost dim.
  Tensor dst2 = *Tensor::Zeros({5, 6, 3}, DType::kF32, Device::Cpu());
  ASSERT_TRUE(CopyBox(src, {0, 0, 2}, &dst2, {0, 0, 0}, {5, 6, 3}).ok());
  EXPECT_EQ(dst2.data<float>()[3 * 1 + 1], s[7 * 1 + 3]);
  absl::Status bad = CopyBox(src, {4, 0, 0}, &dst, {0, 0, 0}, {2, 1, 1});
  EXPECT_EQ(bad.code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace fsdpp
