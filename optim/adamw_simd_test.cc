// The vectorised AdamW step against kernels::AdamWElement, bit for bit, on
// every Highway target this CPU supports, for each compute-copy dtype, odd
// lengths and unaligned starts, over several steps (so m and v evolve).
#include "optim/adamw_simd.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "optim/kernels/adamw.h"

namespace fsdpp {
namespace adamw_simd {
namespace {

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

TEST(AdamWSimdTest, MatchesTheScalarElementBitForBitOnEveryTarget) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType copy_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (bool with_copy : {false, true}) {
        for (int64_t n : {1, 7, 16, 17, 33, 1001}) {
          const int64_t offset = n % 3;  // unaligned starts
          std::mt19937 rng(static_cast<uint32_t>(n));
          std::normal_distribution<float> normal(0.0f, 1.0f);
          std::vector<float> p(n + offset), m(n + offset), v(n + offset),
              g(n + offset);
          for (int64_t i = 0; i < n + offset; ++i) {
            p[i] = normal(rng) * 0.02f;
            m[i] = i % 5 == 0 ? 0.0f : normal(rng) * 1e-3f;
            v[i] = i % 5 == 0 ? 0.0f : std::abs(normal(rng)) * 1e-6f;
          }
          std::vector<float> rp = p, rm = m, rv = v;
          std::vector<uint16_t> copy(n + offset), want_copy(n + offset);
          std::vector<float> copy32(n + offset), want_copy32(n + offset);
          for (int step = 1; step <= 3; ++step) {
            for (int64_t i = 0; i < n + offset; ++i) {
              g[i] = normal(rng) * (i % 7 == 0 ? 1e-8f : 1e-2f);
            }
            kernels::AdamWScalars s =
                kernels::AdamWScalars::Make(3e-4, 0.9, 0.95, 1e-8, 0.1, step);
            // Step 2 clips (the fused gradient-clipping coefficient).
            if (step == 2) s.grad_scale = 0.37f;
            void* out = nullptr;
            if (with_copy) {
              out = copy_dtype == DType::kF32
                        ? static_cast<void*>(copy32.data() + offset)
                        : static_cast<void*>(copy.data() + offset);
            }
            Step(s, g.data() + offset, p.data() + offset, m.data() + offset,
                 v.data() + offset, copy_dtype, out, n);
            for (int64_t i = offset; i < n + offset; ++i) {
              kernels::AdamWElement(s, g[i], &rp[i], &rm[i], &rv[i]);
              if (copy_dtype == DType::kBF16) {
                want_copy[i] = FloatToBFloat16(rp[i]).bits;
              } else if (copy_dtype == DType::kF16) {
                want_copy[i] = FloatToFloat16(rp[i]).bits;
              } else {
                want_copy32[i] = rp[i];
              }
            }
            for (int64_t i = offset; i < n + offset; ++i) {
              const auto where = [&] {
                return testing::Message()
                       << hwy::TargetName(target) << " copy "
                       << DTypeName(copy_dtype) << " " << with_copy
                       << " n=" << n << " step " << step << " element " << i;
              };
              ASSERT_EQ(Bits(p[i]), Bits(rp[i])) << where();
              ASSERT_EQ(Bits(m[i]), Bits(rm[i])) << where();
              ASSERT_EQ(Bits(v[i]), Bits(rv[i])) << where();
              if (with_copy && copy_dtype == DType::kF32) {
                ASSERT_EQ(Bits(copy32[i]), Bits(want_copy32[i])) << where();
              } else if (with_copy) {
                ASSERT_EQ(copy[i], want_copy[i]) << where();
              }
            }
          }
        }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
}  // namespace adamw_simd
}  // namespace fsdpp
