// Tests for Philox4x32-10: Random123's known-answer vectors, slice
// independence (any [a, b) generated alone equals the same slice of the
// whole), and distribution moments.
#include "core/rng.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(RngTest, Random123KnownAnswers) {
  struct Kat {
    Philox4x32 counter;
    uint32_t key0, key1;
    Philox4x32 expected;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}},
       0,
       0,
       {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
       0xffffffff,
       0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
       0xa4093822,
       0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const Kat& k : kats) {
    Philox4x32 out = Philox4x32_10(k.counter, k.key0, k.key1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out.v[i], k.expected.v[i]) << i;
  }
}

TEST(RngTest, SliceEqualsSliceOfWhole) {
  const int64_t n = 1003;
  std::vector<float> whole_u(n), whole_n(n), whole_t(n);
  FillUniform(7, 3, 0, n, -0.5f, 0.5f, whole_u.data());
  FillNormal(7, 3, 0, n, 0.0f, 0.02f, whole_n.data());
  FillTruncatedNormal(7, 3, 0, n, 0.0f, 1.0f, 2.0f, whole_t.data());
  for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 1},
                      {1, 2},
                      {3, 7},
                      {5, 1003},
                      {250, 251},
                      {999, 1003},
                      {0, 1003}}) {
    std::vector<float> u(b - a), z(b - a), t(b - a);
    FillUniform(7, 3, a, b - a, -0.5f, 0.5f, u.data());
    FillNormal(7, 3, a, b - a, 0.0f, 0.02f, z.data());
    FillTruncatedNormal(7, 3, a, b - a, 0.0f, 1.0f, 2.0f, t.data());
    EXPECT_EQ(std::memcmp(u.data(), whole_u.data() + a, u.size() * 4), 0) << a;
    EXPECT_EQ(std::memcmp(z.data(), whole_n.data() + a, z.size() * 4), 0) << a;
    EXPECT_EQ(std::memcmp(t.data(), whole_t.data() + a, t.size() * 4), 0) << a;
  }
}

TEST(RngTest, LargeParallelFillEqualsElementwise) {
  // Above the OpenMP threshold: threads must not change any value.
  const int64_t n = (1 << 17) + 5;
  std::vector<float> v(n);
  FillNormal(11, 0, 123456789, n, 1.0f, 2.0f, v.data());
  for (int64_t i = 0; i < n; i += 977) {
    EXPECT_EQ(v[i], 1.0f + 2.0f * RandomNormal(11, 0, 123456789 + i));
  }
}

TEST(RngTest, SeedsAndStreamsDiffer) {
  EXPECT_NE(RandomBits(1, 0, 0), RandomBits(2, 0, 0));
  EXPECT_NE(RandomBits(1, 0, 0), RandomBits(1, 1, 0));
  EXPECT_NE(RandomBits(1, 0, 0), RandomBits(1, 0, 1));
}

TEST(RngTest, Moments) {
  const int64_t n = 1 << 20;
  std::vector<float> u(n), z(n), t(n);
  FillUniform(3, 9, 0, n, 0.0f, 1.0f, u.data());
  FillNormal(3, 9, 0, n, 0.0f, 1.0f, z.data());
  FillTruncatedNormal(3, 9, 0, n, 0.0f, 1.0f, 2.0f, t.data());
  double su = 0, su2 = 0, sz = 0, sz2 = 0, sz4 = 0, st2 = 0, tmax = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_GE(u[i], 0.0f);
    ASSERT_LT(u[i], 1.0f);
    su += u[i];
    su2 += double(u[i]) * u[i];
    sz += z[i];
    sz2 += double(z[i]) * z[i];
    sz4 += std::pow(double(z[i]), 4);
    st2 += double(t[i]) * t[i];
    tmax = std::max(tmax, std::fabs(double(t[i])));
  }
  // Standard errors at n = 2^20 are ~3e-4 (uniform) and ~1e-3 (normal).
  EXPECT_NEAR(su / n, 0.5, 2e-3);
  EXPECT_NEAR(su2 / n - 0.25, 1.0 / 12, 2e-3);
  EXPECT_NEAR(sz / n, 0.0, 5e-3);
  EXPECT_NEAR(sz2 / n, 1.0, 5e-3);
  EXPECT_NEAR(sz4 / n, 3.0, 3e-2);  // Normal kurtosis.
  EXPECT_LE(tmax, 2.0);
  // Variance of a standard normal truncated at +-2: 0.7737.
  EXPECT_NEAR(st2 / n, 0.7737, 5e-3);
}

}  // namespace
}  // namespace fsdpp
