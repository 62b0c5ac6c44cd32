// Tests for dtype names and the bf16 / f16 round-to-nearest-even conversions
// against an independent reference: the nearest value among all 65536
// encodings (ties to the even encoding), found by search in double precision.
#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

struct Encoded {
  double value;
  uint16_t bits;
};

// All finite non-negative encodings of a 16-bit format, sorted by value.
template <typename Decode>
std::vector<Encoded> PositiveFinite(Decode decode) {
  std::vector<Encoded> out;
  for (uint32_t b = 0; b < 0x8000u; ++b) {
    double v = decode(static_cast<uint16_t>(b));
    if (std::isfinite(v)) out.push_back({v, static_cast<uint16_t>(b)});
  }
  std::sort(out.begin(), out.end(), [](const Encoded& a, const Encoded& b) {
    return a.value < b.value;
  });
  return out;
}

// Reference RNE: nearest encoding; ties go to the even bit pattern; values at
// or beyond max + half an ulp become infinity.
uint16_t ReferenceRound(float f, const std::vector<Encoded>& table,
                        uint16_t inf_bits) {
  const uint16_t sign = std::signbit(f) ? 0x8000u : 0u;
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(a)) return sign | inf_bits;
  const Encoded& max = table.back();
  const double max_ulp = max.value - table[table.size() - 2].value;
  if (a >= max.value + max_ulp / 2) return sign | inf_bits;
  auto it =
      std::lower_bound(table.begin(), table.end(), a,
                       [](const Encoded& e, double v) { return e.value < v; });
  if (it == table.end()) return sign | max.bits;
  if (it->value == a || it == table.begin()) return sign | it->bits;
  const Encoded& hi = *it;
  const Encoded& lo = *(it - 1);
  const double dlo = a - lo.value, dhi = hi.value - a;
  if (dlo < dhi) return sign | lo.bits;
  if (dhi < dlo) return sign | hi.bits;
  return sign | ((lo.bits & 1u) == 0 ? lo.bits : hi.bits);
}

std::vector<float> TestFloats() {
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           1.0f,
                           -1.0f,
                           0.5f,
                           65504.0f,
                           65519.99f,
                           65520.0f,
                           1e-8f,
                           5.96e-8f,
                           2.98023224e-8f,
                           6.1035156e-05f,
                           3.4e38f,
                           -3.4e38f,
                           std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::min(),
                           1.00390625f,
                           1.01171875f,
                           3.0e-5f};
  std::mt19937 gen(42);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(gen);
    float f = BitsToFloat(u);
    if (!std::isnan(f)) xs.push_back(f);
  }
  // Exact ties and near-ties around small magnitudes.
  for (int e = -30; e < 20; ++e) {
    for (uint32_t m = 0; m < 64; ++m) {
      float base = std::ldexp(1.0f + m / 64.0f, e);
      xs.push_back(base);
      xs.push_back(BitsToFloat(FloatBits(base) + 0x1000u));
      xs.push_back(BitsToFloat(FloatBits(base) + 0x8000u));
      xs.push_back(BitsToFloat(FloatBits(base) + 0x7fffu));
    }
  }
  return xs;
}

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI64), 8u);
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32,
                  DType::kI64, DType::kU8}) {
    EXPECT_EQ(*ParseDType(DTypeName(d)), d);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  absl::StatusOr<DType> bad = ParseDType("f8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'f8'"), absl::string_view::npos);
}

TEST(DTypeTest, CountNonFiniteByExponentBits) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> f = {0.0f, -1.5f, inf, 3e38f, -inf, nan, 1e-45f};
  EXPECT_EQ(CountNonFinite(f.data(), f.size(), DType::kF32), 3);
  EXPECT_EQ(CountNonFinite(f.data(), 2, DType::kF32), 0);
  std::vector<BFloat16> b;
  std::vector<Float16> h;
  for (float x : f) {
    b.push_back(FloatToBFloat16(x));
    h.push_back(FloatToFloat16(x));
  }
  EXPECT_EQ(CountNonFinite(b.data(), b.size(), DType::kBF16), 3);
  // 3e38 overflows f16 to inf.
  EXPECT_EQ(CountNonFinite(h.data(), h.size(), DType::kF16), 4);
  // Integers have no non-finite values, whatever their bits.
  const std::vector<int32_t> i = {0x7f800000, -1};
  EXPECT_EQ(CountNonFinite(i.data(), i.size(), DType::kI32), 0);
}

TEST(DTypeTest, BFloat16MatchesReferenceRounding) {
  auto table = PositiveFinite([](uint16_t b) {
    return static_cast<double>(BFloat16ToFloat(BFloat16::FromBits(b)));
  });
  for (float f : TestFloats()) {
    ASSERT_EQ(FloatToBFloat16(f).bits, ReferenceRound(f, table, 0x7f80u))
        << "f=" << f << " bits=" << std::hex << FloatBits(f);
  }
}

TEST(DTypeTest, Float16MatchesReferenceRounding) {
  auto table = PositiveFinite([](uint16_t b) {
    return static_cast<double>(Float16ToFloat(Float16::FromBits(b)));
  });
  // The decoder itself against the format's definition.
  EXPECT_EQ(Float16ToFloat(Float16::FromBits(0x3c00)), 1.0f);
  EXPECT_EQ(Float16ToFloat(Float16::FromBits(0x7bff)), 65504.0f);
  EXPECT_EQ(Float16ToFloat(Float16::FromBits(0x0001)), std::ldexp(1.0f, -24));
  EXPECT_EQ(Float16ToFloat(Float16::FromBits(0x0400)), std::ldexp(1.0f, -14));
  EXPECT_EQ(Float16ToFloat(Float16::FromBits(0xc000)), -2.0f);
  for (float f : TestFloats()) {
    ASSERT_EQ(FloatToFloat16(f).bits, ReferenceRound(f, table, 0x7c00u))
        << "f=" << f << " bits=" << std::hex << FloatBits(f);
  }
}

TEST(DTypeTest, RoundTripsEveryEncodingAndKeepsNaN) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    float bf = BFloat16ToFloat(BFloat16::FromBits(bits));
    float hf = Float16ToFloat(Float16::FromBits(bits));
    if (std::isnan(bf)) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(bf))));
    } else {
      ASSERT_EQ(FloatToBFloat16(bf).bits, bits);
    }
    if (std::isnan(hf)) {
      EXPECT_TRUE(std::isnan(Float16ToFloat(FloatToFloat16(hf))));
    } else {
      ASSERT_EQ(FloatToFloat16(hf).bits, bits);
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(nan))));
  EXPECT_TRUE(
      std::isnan(BFloat16ToFloat(FloatToBFloat16(BitsToFloat(0x7f800001u)))));
  EXPECT_TRUE(
      std::isnan(Float16ToFloat(FloatToFloat16(BitsToFloat(0x7f800001u)))));
  // A signalling f16 NaN widens to a quiet f32 NaN with its payload and sign.
  EXPECT_EQ(FloatBits(Float16ToFloat(Float16::FromBits(0x7c01u))), 0x7fc02000u);
  EXPECT_EQ(FloatBits(Float16ToFloat(Float16::FromBits(0xfe01u))), 0xffc02000u);
  EXPECT_EQ(FloatBits(Float16ToFloat(Float16::FromBits(0x7c00u))), 0x7f800000u);
}

}  // namespace
}  // namespace fsdpp
