// Per-target f32 <-> storage conversions for Highway kernels: LoadF reads
// Lanes(DF()) elements of f32 / bf16 / f16 as an f32 vector, StoreF writes
// one back rounding to nearest even with NaN kept quiet, bit for bit as
// core/dtype.h's FloatToBFloat16 / FloatToFloat16 / *ToFloat do. Include it
// from a file that goes through hwy/foreach_target.h, after hwy/highway.h
// (Highway's -inl.h convention: re-included once per target).
#if defined(FSDPP_TENSOR_CPU_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FSDPP_TENSOR_CPU_CONVERT_INL_H_
#undef FSDPP_TENSOR_CPU_CONVERT_INL_H_
#else
#define FSDPP_TENSOR_CPU_CONVERT_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace fsdpp {
namespace simd_convert {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// x86 targets from AVX2 up have F16C, whose conversions round to nearest
// even and keep NaNs quiet exactly as core/dtype.h does.
#undef FSDPP_SIMD_F16C
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define FSDPP_SIMD_F16C 1
#else
#define FSDPP_SIMD_F16C 0
#endif

// Lanes(DF()) storage elements as f32.
HWY_INLINE VF LoadF(DF d, const float* p) { return hn::LoadU(d, p); }

HWY_INLINE VF LoadF(DF d, const BFloat16* p) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToUnsigned<DF> du;
  const auto wide =
      hn::PromoteTo(du, hn::LoadU(d16, reinterpret_cast<const uint16_t*>(p)));
  return hn::BitCast(d, hn::ShiftLeft<16>(wide));
}

HWY_INLINE VF LoadF(DF d, const Float16* p) {
#if FSDPP_SIMD_F16C
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(
      d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
#else
  HWY_ALIGN float wide[HWY_MAX_BYTES / sizeof(float)];
  for (size_t i = 0; i < hn::Lanes(d); ++i) wide[i] = Float16ToFloat(p[i]);
  return hn::Load(d, wide);
#endif
}

// f32 lanes rounded to bf16, as the bits of an f32 whose low half is zero:
// (bits + 0x7fff + lsb) with the low half cleared, as FloatToBFloat16; a NaN
// keeps its top half, made quiet.
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> Bf16HighBits(DF d, VF v) {
  (void)d;
  const hn::RebindToUnsigned<DF> du;
  const auto bits = hn::BitCast(du, v);
  const auto high = hn::Set(du, 0xffff0000u);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded =
      hn::And(hn::Add(bits, hn::Add(lsb, hn::Set(du, 0x7fffu))), high);
  const auto quiet_nan = hn::And(hn::Or(bits, hn::Set(du, 0x400000u)), high);
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
}

// Stores f32 lanes as the storage type, rounding to nearest even.
HWY_INLINE void StoreF(DF d, VF v, float* p) { hn::StoreU(v, d, p); }

HWY_INLINE void StoreF(DF d, VF v, BFloat16* p) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToSigned<DF> di;
  const auto half = hn::ShiftRight<16>(Bf16HighBits(d, v));
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, half)), d16,
             reinterpret_cast<uint16_t*>(p));
}

HWY_INLINE void StoreF(DF d, VF v, Float16* p) {
  (void)d;
#if FSDPP_SIMD_F16C
  const hn::Rebind<hwy::float16_t, DF> dh;
  hn::StoreU(hn::DemoteTo(dh, v), dh, reinterpret_cast<hwy::float16_t*>(p));
#else
  HWY_ALIGN float wide[HWY_MAX_BYTES / sizeof(float)];
  hn::Store(v, d, wide);
  for (size_t i = 0; i < hn::Lanes(d); ++i) p[i] = FloatToFloat16(wide[i]);
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace simd_convert
}  // namespace fsdpp
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
