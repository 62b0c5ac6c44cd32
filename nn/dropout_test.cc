// Keyed dropout: the rate and scale, a mask that follows the elements (a
// slice of the features, of the columns or a permutation of the rows gets
// the whole's mask there), bf16, and bad input.
#include "nn/dropout.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using testing_util::RandomTensor;

constexpr int64_t kB = 3, kT = 16, kF = 24;

DropoutRows Rows(std::vector<uint64_t> keys, std::vector<int64_t> columns) {
  DropoutRows rows;
  rows.keys = std::move(keys);
  rows.columns = std::move(columns);
  return rows;
}

std::vector<int64_t> Iota(int64_t n, int64_t from = 0) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

std::vector<float> Drop(const Tensor& x, float p, uint64_t key, int64_t offset,
                        int64_t features, const DropoutRows& rows) {
  Tensor out = *Tensor::Empty(x.shape(), x.dtype(), Device::Cpu());
  const absl::Status s = KeyedDropout(x, p, key, offset, features, rows, &out);
  EXPECT_TRUE(s.ok()) << s;
  return *out.ToFloats();
}

TEST(KeyedDropoutTest, DropsAtTheRateAndScalesTheRest) {
  const Tensor ones =
      *Tensor::FromFloats({8, 64, 32}, std::vector<float>(8 * 64 * 32, 1.0f));
  const DropoutRows rows = Rows({1, 2, 3, 4, 5, 6, 7, 8}, Iota(64));
  const std::vector<float> y = Drop(ones, 0.3f, 11, 0, 32, rows);
  int64_t dropped = 0;
  for (float v : y) {
    if (v == 0.0f) {
      ++dropped;
    } else {
      EXPECT_FLOAT_EQ(v, 1.0f / 0.7f);
    }
  }
  EXPECT_NEAR(static_cast<double>(dropped) / y.size(), 0.3, 0.02);
  // p = 0 keeps everything as it is; another layer key drops other ones.
  EXPECT_EQ(Drop(ones, 0.0f, 11, 0, 32, rows), *ones.ToFloats());
  EXPECT_NE(Drop(ones, 0.3f, 12, 0, 32, rows), y);
}

// The mask belongs to (row key, column, feature): a tensor-parallel slice
// of the features, a context-parallel subset of the columns and rows in
// another order each get exactly the whole's.
TEST(KeyedDropoutTest, TheMaskFollowsTheElementsAcrossLayouts) {
  const Tensor x = RandomTensor({kB, kT, kF}, DType::kF32, 3);
  const std::vector<float> xs = *x.ToFloats();
  const DropoutRows rows = Rows({7, 9, 40}, Iota(kT));
  const std::vector<float> whole = Drop(x, 0.25f, 5, 0, kF, rows);
  const auto at = [&](int64_t b, int64_t t, int64_t f) {
    return whole[(b * kT + t) * kF + f];
  };
  // Features [8, 16) of 24.
  std::vector<float> slice;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t t = 0; t < kT; ++t) {
      for (int64_t f = 8; f < 16; ++f)
        slice.push_back(xs[(b * kT + t) * kF + f]);
    }
  }
  const std::vector<float> sliced =
      Drop(*Tensor::FromFloats({kB, kT, 8}, slice), 0.25f, 5, 8, kF, rows);
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t t = 0; t < kT; ++t) {
      for (int64_t f = 0; f < 8; ++f) {
        ASSERT_EQ(sliced[(b * kT + t) * 8 + f], at(b, t, f + 8));
      }
    }
  }
  // Columns 12..15 then 0..3 (a load-balanced context-parallel rank's),
  // rows reversed.
  const std::vector<int64_t> columns = {12, 13, 14, 15, 0, 1, 2, 3};
  std::vector<float> part;
  for (int64_t b = kB - 1; b >= 0; --b) {
    for (int64_t c : columns) {
      for (int64_t f = 0; f < kF; ++f)
        part.push_back(xs[(b * kT + c) * kF + f]);
    }
  }
  const std::vector<float> parted =
      Drop(*Tensor::FromFloats({kB, 8, kF}, part), 0.25f, 5, 0, kF,
           Rows({40, 9, 7}, columns));
  for (int64_t i = 0; i < kB; ++i) {
    for (size_t j = 0; j < columns.size(); ++j) {
      for (int64_t f = 0; f < kF; ++f) {
        ASSERT_EQ(parted[(i * 8 + j) * kF + f], at(kB - 1 - i, columns[j], f));
      }
    }
  }
}

TEST(KeyedDropoutTest, Bf16InPlaceAndBadInput) {
  const Tensor x = RandomTensor({kB, kT, kF}, DType::kF32, 4);
  const DropoutRows rows = Rows({1, 2, 3}, Iota(kT));
  const std::vector<float> f32 = Drop(x, 0.5f, 2, 0, kF, rows);
  Tensor bf16 = *Tensor::Empty(x.shape(), DType::kBF16, Device::Cpu());
  ASSERT_TRUE(Copy(x, &bf16).ok());
  ASSERT_TRUE(
      KeyedDropout(bf16, 0.5f, 2, 0, kF, rows, &bf16).ok());  // in place
  const std::vector<float> got = *bf16.ToFloats();
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], f32[i], 1e-2 * (1 + std::fabs(f32[i])));
    ASSERT_EQ(got[i] == 0.0f, f32[i] == 0.0f);
  }
  Tensor out = *Tensor::Empty(x.shape(), DType::kF32, Device::Cpu());
  for (const absl::Status& s :
       {KeyedDropout(x, 1.0f, 2, 0, kF, rows, &out),
        KeyedDropout(x, -0.1f, 2, 0, kF, rows, &out),
        KeyedDropout(x, 0.1f, 2, 1, kF, rows, &out),  // past the features
        KeyedDropout(x, 0.1f, 2, 0, kF, Rows({1, 2}, Iota(kT)), &out),
        KeyedDropout(x, 0.1f, 2, 0, kF, Rows({1, 2, 3}, Iota(kT - 1)), &out)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  // Installed rows on this thread, for the scope only.
  EXPECT_EQ(DropoutRows::Active(), nullptr);
  {
    DropoutRows::Scope scope(&rows);
    EXPECT_EQ(DropoutRows::Active(), &rows);
  }
  EXPECT_EQ(DropoutRows::Active(), nullptr);
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
