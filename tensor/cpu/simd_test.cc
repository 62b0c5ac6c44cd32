// The vectorised kernels against the scalar reference, bit for bit, on every
// Highway target this CPU supports (AVX-512, AVX2 and the emulated 128-bit
// one): odd lengths, unaligned starts, in-place use, and
// values that exercise rounding ties, subnormals, overflow, infinities and
// NaNs.
#include "tensor/cpu/simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "tensor/cpu/simd_testing.h"
#include "tensor/kernels/elementwise.h"

namespace fsdpp {
namespace cpu {
namespace simd {
namespace {

using testing_util::Bits;
using testing_util::Buffer;
using testing_util::EachTarget;
using testing_util::kFloatTypes;
using testing_util::Where;

// Lengths around the vector widths (4, 8, 16 lanes) and a long one.
const int64_t kLengths[] = {0, 1, 3, 7, 8, 15, 16, 17, 31, 33, 64, 1000};

// Values with hard cases mixed into random ones, as f32.
std::vector<float> Values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  const float specials[] = {
      0.0f,
      -0.0f,
      1.0f + 1.0f / 256,   // a bf16 tie (rounds to even)
      1.0f + 3.0f / 256,   // a bf16 tie rounding up
      1.0f + 1.0f / 2048,  // an f16 tie
      65504.0f,            // f16 max
      65520.0f,            // rounds to f16 inf
      1e-6f,               // an f16 subnormal
      3e-8f,               // rounds to f16 zero or min subnormal
      std::numeric_limits<float>::denorm_min(),
      std::numeric_limits<float>::max(),
      std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN(),
      -std::numeric_limits<float>::quiet_NaN(),
      BitsToFloat(0x7f800001u),  // a signalling NaN
      BitsToFloat(0x7fc12345u),  // a NaN with payload
  };
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    v[i] = i % 3 == 0 ? specials[(i / 3) % (sizeof(specials) / 4)]
                      : uniform(rng) * std::pow(2.0f, (i % 11) - 5.0f);
  }
  return v;
}

TEST(SimdTest, CastsMatchTheScalarConversionsBitForBit) {
  EachTarget each;
  ASSERT_FALSE(each.targets().empty());
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType from : kFloatTypes) {
      for (DType to : kFloatTypes) {
        for (int64_t n : kLengths) {
          for (int64_t offset : {0, 1, 3}) {
            const std::vector<float> values = Values(n, 7 + n);
            Buffer src(from, values, offset);
            Buffer got(to, std::vector<float>(n, 0.0f), offset == 0 ? 1 : 0);
            Buffer want(to, std::vector<float>(n, 0.0f), 0);
            Cast(from, src.data(), to, got.data(), n);
            for (int64_t i = 0; i < n; ++i) want.Set(i, src.Get(i));
            for (int64_t i = 0; i < n; ++i) {
              ASSERT_EQ(Bits(got, i), Bits(want, i))
                  << Where(target, from, n, offset) << " -> " << DTypeName(to)
                  << " element " << i << " = " << src.Get(i);
            }
          }
        }
      }
    }
  }
}

TEST(SimdTest, EveryF16AndBf16ValueWidensExactly) {
  EachTarget each;
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType from : {DType::kBF16, DType::kF16}) {
      std::vector<uint16_t> all(1 << 16);
      for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
      std::vector<float> wide(all.size());
      Cast(from, all.data(), DType::kF32, wide.data(), all.size());
      for (uint32_t i = 0; i < all.size(); ++i) {
        const float want =
            from == DType::kBF16
                ? BFloat16ToFloat(BFloat16::FromBits(i))
                : Float16ToFloat(Float16::FromBits(static_cast<uint16_t>(i)));
        ASSERT_EQ(FloatBits(wide[i]), FloatBits(want))
            << hwy::TargetName(target) << " " << DTypeName(from) << " bits "
            << i;
      }
    }
  }
}

// Runs `simd` and the scalar `op` through f32 on the same inputs and
// compares the stored results bitwise; `in_place` writes over `a`.
template <class Simd, class Op>
void CheckBinary(const char* name, Simd simd, Op op, bool in_place) {
  EachTarget each;
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType dtype : kFloatTypes) {
      for (int64_t n : kLengths) {
        for (int64_t offset : {0, 2}) {
          Buffer a(dtype, Values(n, 11 + n), offset);
          Buffer b(dtype, Values(n, 29 + n), offset == 0 ? 1 : 0);
          Buffer want(dtype, std::vector<float>(n, 0.0f), 0);
          for (int64_t i = 0; i < n; ++i) want.Set(i, op(a.Get(i), b.Get(i)));
          Buffer out(dtype, std::vector<float>(n, 0.0f), 3);
          Buffer& got = in_place ? a : out;
          simd(dtype, a.data(), b.data(), got.data(), n);
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(Bits(got, i), Bits(want, i))
                << name << " " << Where(target, dtype, n, offset)
                << (in_place ? " in place" : "") << " element " << i;
          }
        }
      }
    }
  }
}

TEST(SimdTest, AddMulAxpyScaleMatchTheScalarOpsBitForBit) {
  for (bool in_place : {false, true}) {
    CheckBinary("add", Add, kernels::AddOp{}, in_place);
    CheckBinary("mul", Mul, kernels::MulOp{}, in_place);
    for (float alpha : {1e-3f, -0.75f, 3.0f}) {
      CheckBinary(
          "axpy",
          [alpha](DType d, const void* y, const void* x, void* out, int64_t n) {
            Axpy(d, alpha, y, x, out, n);
          },
          kernels::AxpyOp{alpha}, in_place);
      CheckBinary(
          "scale",
          [alpha](DType d, const void* x, const void*, void* out, int64_t n) {
            Scale(d, alpha, x, out, n);
          },
          [alpha](float x, float) { return kernels::ScaleOp{alpha}(x); },
          in_place);
    }
  }
}

TEST(SimdTest, ActivationsMatchTheScalarFunctorsBitForBit) {
  for (bool in_place : {false, true}) {
    CheckBinary(
        "gelu",
        [](DType d, const void* x, const void*, void* out, int64_t n) {
          Gelu(d, x, out, n);
        },
        [](float x, float) { return kernels::GeluOp{}(x); }, in_place);
    CheckBinary(
        "silu",
        [](DType d, const void* x, const void*, void* out, int64_t n) {
          Silu(d, x, out, n);
        },
        [](float x, float) { return kernels::SiluOp{}(x); }, in_place);
    CheckBinary("gelu backward", GeluBackward, kernels::GeluBackwardOp{},
                in_place);
    CheckBinary("silu backward", SiluBackward, kernels::SiluBackwardOp{},
                in_place);
  }
}

// Every f32 input around the ends of ExpApprox's domain and of tanh's
// saturation, bitwise against the scalar functions on every target.
TEST(SimdTest, ActivationsMatchAtTheEdgesOfTheExpDomain) {
  std::vector<float> x;
  for (float edge : {kernels::kExpHi, kernels::kExpLo, 44.15f, 22.0f, 0.0f}) {
    for (float sign : {1.0f, -1.0f}) {
      float v = sign * edge;
      for (int i = 0; i < 64; ++i) v = std::nextafter(v, -INFINITY);
      for (int i = 0; i < 128; ++i) {
        x.push_back(v);
        v = std::nextafter(v, INFINITY);
      }
    }
  }
  const int64_t n = static_cast<int64_t>(x.size());
  EachTarget each;
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::vector<float> gelu(n), silu(n), dgelu(n), dsilu(n);
    const std::vector<float> dy(n, 1.0f);
    Gelu(DType::kF32, x.data(), gelu.data(), n);
    Silu(DType::kF32, x.data(), silu.data(), n);
    GeluBackward(DType::kF32, x.data(), dy.data(), dgelu.data(), n);
    SiluBackward(DType::kF32, x.data(), dy.data(), dsilu.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      ASSERT_EQ(FloatBits(gelu[i]), FloatBits(kernels::GeluOp{}(v)))
          << hwy::TargetName(target) << " gelu(" << v << ")";
      ASSERT_EQ(FloatBits(silu[i]), FloatBits(kernels::SiluOp{}(v)))
          << hwy::TargetName(target) << " silu(" << v << ")";
      ASSERT_EQ(FloatBits(dgelu[i]),
                FloatBits(kernels::GeluBackwardOp{}(v, 1.0f)))
          << hwy::TargetName(target) << " gelu'(" << v << ")";
      ASSERT_EQ(FloatBits(dsilu[i]),
                FloatBits(kernels::SiluBackwardOp{}(v, 1.0f)))
          << hwy::TargetName(target) << " silu'(" << v << ")";
    }
  }
}

// bf16 and f16 look their activations up in tables of the scalar functors:
// every one of the 2^16 inputs (NaNs, infinities, subnormals included), with
// a gradient that varies per element, bitwise against the functors, on every
// target, from an unaligned start so that the tail runs too.
TEST(SimdTest, EverySixteenBitInputGetsTheScalarActivation) {
  const int64_t n = int64_t{1} << 16;
  std::vector<float> dy_values = Values(n, 5);
  EachTarget each;
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      // Every bit pattern, rotated by 1 so the vectors start mid-table.
      std::vector<uint16_t> x(n + 1);
      for (int64_t i = 0; i < n; ++i) x[i + 1] = static_cast<uint16_t>(i + 7);
      Buffer dy(dtype, dy_values, 1);
      const auto value = [&](int64_t i) {
        return dtype == DType::kBF16 ? BFloat16ToFloat(BFloat16::FromBits(x[i]))
                                     : Float16ToFloat(Float16::FromBits(x[i]));
      };
      const auto round = [&](float f) -> uint16_t {
        return dtype == DType::kBF16 ? FloatToBFloat16(f).bits
                                     : FloatToFloat16(f).bits;
      };
      std::vector<uint16_t> gelu(n), silu(n), dgelu(n), dsilu(n);
      Gelu(dtype, x.data() + 1, gelu.data(), n);
      Silu(dtype, x.data() + 1, silu.data(), n);
      GeluBackward(dtype, x.data() + 1, dy.data(), dgelu.data(), n);
      SiluBackward(dtype, x.data() + 1, dy.data(), dsilu.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const float v = value(i + 1), g = dy.Get(i);
        const std::string where = absl::StrCat(
            hwy::TargetName(target), " ", DTypeName(dtype), " bits ", x[i + 1]);
        ASSERT_EQ(gelu[i], round(kernels::GeluOp{}(v))) << "gelu " << where;
        ASSERT_EQ(silu[i], round(kernels::SiluOp{}(v))) << "silu " << where;
        ASSERT_EQ(dgelu[i], round(kernels::GeluBackwardOp{}(v, g)))
            << "gelu' " << where;
        ASSERT_EQ(dsilu[i], round(kernels::SiluBackwardOp{}(v, g)))
            << "silu' " << where;
      }
    }
  }
}

// The stated error bounds of the approximations (tensor/kernels/
// elementwise.h), measured against double precision on dense sweeps.
TEST(SimdTest, ExpAndTanhApproximationsStayWithinTheirStatedErrors) {
  double exp_rel = 0, tanh_abs = 0, gelu_err = 0, silu_err = 0;
  for (float x = kernels::kExpLo; x <= kernels::kExpHi;
       x += 1.0f / 1024 + std::fabs(x) / 65536) {
    const double want = std::exp(static_cast<double>(x));
    exp_rel = std::max(exp_rel, std::fabs(kernels::ExpApprox(x) - want) / want);
  }
  for (float x = -20.0f; x <= 20.0f; x += 1.0f / 4096) {
    const double xd = x;
    tanh_abs =
        std::max(tanh_abs, std::fabs(kernels::TanhApprox(x) - std::tanh(xd)));
    // GELU and SiLU: error relative to |x| (their size away from the
    // origin; near it both are ~x / 2).
    const double inner =
        kernels::kGeluScale * (xd + kernels::kGeluCubic * xd * xd * xd);
    const double gelu = 0.5 * xd * (1.0 + std::tanh(inner));
    const double silu = xd / (1.0 + std::exp(-xd));
    if (x != 0.0f) {
      gelu_err = std::max(gelu_err,
                          std::fabs(kernels::GeluOp{}(x)-gelu) / std::fabs(xd));
      silu_err = std::max(silu_err,
                          std::fabs(kernels::SiluOp{}(x)-silu) / std::fabs(xd));
    }
  }
  std::printf(
      "max errors: exp %.3g relative, tanh %.3g absolute, gelu %.3g and silu "
      "%.3g relative to |x|\n",
      exp_rel, tanh_abs, gelu_err, silu_err);
  EXPECT_LE(exp_rel, 1e-7);
  EXPECT_LE(tanh_abs, 1.5e-7);
  EXPECT_LE(gelu_err, 2e-7);
  EXPECT_LE(silu_err, 2e-7);
  EXPECT_EQ(kernels::ExpApprox(0.0f), 1.0f);
  EXPECT_EQ(kernels::ExpApprox(kernels::kExpHi + 0.01f), INFINITY);
  EXPECT_EQ(FloatBits(kernels::ExpApprox(kernels::kExpLo - 0.01f)), 0u);
  EXPECT_TRUE(std::isnan(kernels::ExpApprox(NAN)));
  EXPECT_EQ(kernels::TanhApprox(50.0f), 1.0f);
  EXPECT_EQ(kernels::TanhApprox(-50.0f), -1.0f);
}

TEST(SimdTest, DispatchesToATargetThisCpuHas) {
  const std::string name = TargetName();
  EXPECT_FALSE(name.empty());
  bool found = false;
  std::string tested;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    found |= name == hwy::TargetName(target);
    absl::StrAppend(&tested, " ", hwy::TargetName(target));
  }
  EXPECT_TRUE(found) << name;
  std::printf("dispatched to %s; targets tested:%s\n", name.c_str(),
              tested.c_str());
}

}  // namespace
}  // namespace simd
}  // namespace cpu
}  // namespace fsdpp
