// Tests for Tensor: creation, views sharing storage, meta tensors, exact
// memory accounting through the allocator.
#include "tensor/tensor.h"

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

class TensorTest : public testing::Test {
 protected:
  void SetUp() override { previous_ = SetAllocator(&alloc_); }
  void TearDown() override { SetAllocator(previous_); }
  CpuAllocator alloc_;
  Allocator* previous_ = nullptr;
};

TEST_F(TensorTest, EmptyAccountsExactBytesUnderItsTag) {
  {
    Tensor t =
        *Tensor::Empty({3, 5}, DType::kBF16, Device::Cpu(), MemoryTag::kParams);
    EXPECT_EQ(t.numel(), 15);
    EXPECT_EQ(t.nbytes(), 30u);
    EXPECT_EQ(t.dim(-1), 5);
    EXPECT_EQ(t.ToString(), "bf16[3, 5] cpu");
    EXPECT_EQ(alloc_.Stats().current_of(MemoryTag::kParams), 30);
    Tensor copy = t;  // Shares storage: no new bytes.
    EXPECT_TRUE(copy.SharesStorageWith(t));
    EXPECT_EQ(alloc_.Stats().total_current, 30);
  }
  EXPECT_EQ(alloc_.Stats().total_current, 0);
  EXPECT_EQ(alloc_.Stats().peak_of(MemoryTag::kParams), 30);
}

TEST_F(TensorTest, MetaTensorsAllocateNothing) {
  Tensor t = *Tensor::Empty({1 << 20, 1 << 10}, DType::kF32, Device::Meta(),
                            MemoryTag::kParams);
  EXPECT_TRUE(t.is_meta());
  EXPECT_EQ(t.raw_data(), nullptr);
  EXPECT_EQ(t.numel(), int64_t{1} << 30);
  EXPECT_EQ(alloc_.Stats().total_peak, 0);
  Tensor z = *Tensor::Zeros({4}, DType::kF32, Device::Meta());
  EXPECT_EQ(alloc_.Stats().total_peak, 0);
  Tensor view = *t.Narrow(5, 10);
  EXPECT_EQ(view.shape(), (Shape{10, 1 << 10}));
  EXPECT_FALSE(z.ToFloats().ok());
}

TEST_F(TensorTest, NarrowAndReshapeShareStorage) {
  std::vector<float> v(24);
  for (int i = 0; i < 24; ++i) v[i] = i;
  Tensor t = *Tensor::FromFloats({6, 4}, v);
  Tensor rows = *t.Narrow(2, 3);
  EXPECT_EQ(rows.shape(), (Shape{3, 4}));
  EXPECT_TRUE(rows.SharesStorageWith(t));
  EXPECT_EQ(rows.storage_offset(), 2 * 4 * sizeof(float));
  EXPECT_EQ(rows.data<float>()[0], 8.0f);
  rows.data<float>()[1] = -1.0f;
  EXPECT_EQ(t.data<float>()[9], -1.0f);
  Tensor r = *rows.Reshape({-1});
  EXPECT_EQ(r.shape(), (Shape{12}));
  EXPECT_EQ(r.data<float>()[0], 8.0f);
  Tensor r2 = *t.Reshape({2, -1, 3});
  EXPECT_EQ(r2.shape(), (Shape{2, 4, 3}));
  EXPECT_EQ(t.Flatten().shape(), (Shape{24}));
  Tensor empty = *t.Narrow(6, 0);
  EXPECT_EQ(empty.numel(), 0);
}

// Ids checked on the host: the bound belongs to the storage, so every view
// of it sees it; a fresh tensor has none.
TEST_F(TensorTest, IdsCheckedBelowIsSharedByViews) {
  absl::StatusOr<Tensor> ids = Tensor::FromInts({2, 3}, {0, 1, 2, 3, 4, 5});
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->ids_checked_below(), 0);
  absl::StatusOr<Tensor> flat = ids->Reshape({6});
  absl::StatusOr<Tensor> row = ids->Narrow(1, 1);
  ASSERT_TRUE(flat.ok() && row.ok());
  ids->MarkIdsCheckedBelow(6);
  EXPECT_EQ(flat->ids_checked_below(), 6);
  EXPECT_EQ(row->ids_checked_below(), 6);
  absl::StatusOr<Tensor> other = Tensor::FromInts({1}, {7});
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->ids_checked_below(), 0);
}

TEST_F(TensorTest, BadViewsAndShapesAreErrors) {
  Tensor t = *Tensor::Zeros({4, 3}, DType::kF32, Device::Cpu());
  absl::StatusOr<Tensor> n = t.Narrow(3, 2);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(
      n.status().message().find("rows [3, 5) out of range for f32[4, 3] cpu"),
      absl::string_view::npos)
      << n.status();
  absl::StatusOr<Tensor> r = t.Reshape({5, 2});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("[5, 2] has 10 elements"),
            absl::string_view::npos)
      << r.status();
  EXPECT_FALSE(t.Reshape({-1, -1}).ok());
  EXPECT_FALSE(t.Reshape({5, -1}).ok());
  EXPECT_FALSE(Tensor::Empty({2, -3}, DType::kF32, Device::Cpu()).ok());
  EXPECT_FALSE(Tensor::FromFloats({2}, {1.0f, 2.0f, 3.0f}).ok());
  absl::StatusOr<Tensor> cuda =
      Tensor::Empty({2}, DType::kF32, Device::Cuda(0));
#if !defined(FSDPP_WITH_CUDA)
  ASSERT_FALSE(cuda.ok());
  EXPECT_NE(cuda.status().message().find("no allocator for device cuda:0"),
            absl::string_view::npos);
#endif
}

TEST_F(TensorTest, ZerosAndConversions) {
  Tensor z = *Tensor::Zeros({5}, DType::kBF16, Device::Cpu());
  EXPECT_EQ(*z.ToFloats(), std::vector<float>(5, 0.0f));
  Tensor b = *Tensor::FromFloats({3}, {1.0f, 1.00390625f, -2.5f}, DType::kBF16);
  // 1 + 2^-8 is a tie between bf16 neighbours 1 and 1 + 2^-7: rounds to even.
  EXPECT_EQ(*b.ToFloats(), (std::vector<float>{1.0f, 1.0f, -2.5f}));
  Tensor ids = *Tensor::FromInts({2}, {7, -3}, DType::kI64);
  EXPECT_EQ(*ids.ToFloats(), (std::vector<float>{7.0f, -3.0f}));
  EXPECT_EQ(*ids.ToInts(), (std::vector<int64_t>{7, -3}));
  Tensor ids32 = *Tensor::FromInts({3}, {0, 2147483647, -100}, DType::kI32);
  EXPECT_EQ(*ids32.ToInts(), (std::vector<int64_t>{0, 2147483647, -100}));
  EXPECT_FALSE(b.ToInts().ok());  // Not ids.
  EXPECT_FALSE(Tensor::FromInts({1}, {1}, DType::kF32).ok());
}

}  // namespace
}  // namespace fsdpp
