// Element types and the 16-bit float formats.
//
// bf16 and f16 are stored as raw 16-bit patterns (BFloat16, Float16) with
// explicit round-to-nearest-even conversions written once for host and CUDA
// code, so the CPU and GPU paths round identically. NaN stays NaN (quiet) and
// overflow rounds to infinity, as IEEE 754 requires.
#ifndef FSDPP_CORE_DTYPE_H_
#define FSDPP_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/macros.h"

namespace fsdpp {

// Element type of a tensor or buffer.
enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kI64, kU8 };

// Bytes per element.
constexpr size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kI64:
      return 8;
    case DType::kU8:
      return 1;
  }
  return 0;
}

// True for f32, bf16 and f16.
constexpr bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

// "f32", "bf16", "f16", "i32", "i64", "u8".
const char* DTypeName(DType dtype);

// How many of the `count` elements of `dtype` at host address `data` are
// inf or NaN (by their exponent bits, whatever the compiler's floating-point
// flags); 0 for integer dtypes. One pass at memory speed: checkpoints run it
// over what they write and read (SaveOptions / LoadOptions::check_finite).
int64_t CountNonFinite(const void* data, int64_t count, DType dtype);

// Parses DTypeName() output (also "float32", "bfloat16", "float16", "int32",
// "int64", "uint8"); anything else is InvalidArgument naming the text.
absl::StatusOr<DType> ParseDType(absl::string_view name);

FSDPP_INLINE uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FSDPP_INLINE float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// bfloat16: the upper 16 bits of an IEEE binary32.
struct BFloat16 {
  uint16_t bits = 0;

  BFloat16() = default;
  FSDPP_HOST_DEVICE static BFloat16 FromBits(uint16_t b) {
    BFloat16 h;
    h.bits = b;
    return h;
  }
};

// Round-to-nearest-even f32 -> bf16.
FSDPP_INLINE BFloat16 FloatToBFloat16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force quiet.
    return BFloat16::FromBits(static_cast<uint16_t>((u >> 16) | 0x0040u));
  }
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return BFloat16::FromBits(static_cast<uint16_t>((u + rounding_bias) >> 16));
}

FSDPP_INLINE float BFloat16ToFloat(BFloat16 h) {
  return BitsToFloat(static_cast<uint32_t>(h.bits) << 16);
}

// IEEE binary16.
struct Float16 {
  uint16_t bits = 0;

  Float16() = default;
  FSDPP_HOST_DEVICE static Float16 FromBits(uint16_t b) {
    Float16 h;
    h.bits = b;
    return h;
  }
};

// Round-to-nearest-even f32 -> f16, with subnormals, overflow to inf, NaN.
FSDPP_INLINE Float16 FloatToFloat16(float f) {
  uint32_t u = FloatBits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN
    return Float16::FromBits(
        static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu)));
  }
  if (abs >= 0x477ff000u) {  // >= 65520 rounds to inf (also inf itself).
    return Float16::FromBits(static_cast<uint16_t>(sign | 0x7c00u));
  }
  if (abs < 0x38800000u) {    // Below the smallest normal f16 (2^-14).
    if (abs < 0x33000000u) {  // < 2^-25: rounds to zero (2^-25 ties to even 0).
      return Float16::FromBits(sign);
    }
    // Subnormal: value = mant * 2^-24 with the implicit bit restored.
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    // abs = mant * 2^(exp-150); in units of 2^-24 that is mant >> (126-exp).
    uint32_t shift = 126u - exp;
    uint32_t result = mant >> shift;
    uint32_t remainder = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (remainder > half || (remainder == half && (result & 1u))) ++result;
    return Float16::FromBits(static_cast<uint16_t>(sign | result));
  }
  // Normal: rebias exponent (127 -> 15) and round 13 dropped bits.
  uint32_t rebased = abs - (112u << 23);
  uint32_t result = rebased >> 13;
  uint32_t remainder = rebased & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return Float16::FromBits(static_cast<uint16_t>(sign | result));
}

FSDPP_INLINE float Float16ToFloat(Float16 h) {
  uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // Subnormal: mant * 2^-24.
    float value = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -value : value;
  }
  if (exp == 31) {  // Inf, or NaN: payload kept, made quiet (as F16C does).
    return BitsToFloat(sign | 0x7f800000u | (mant << 13) |
                       (mant != 0 ? 0x400000u : 0u));
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Uniform load/store as f32 for kernels templated on the storage type.
FSDPP_INLINE float ToFloat(float x) { return x; }
FSDPP_INLINE float ToFloat(BFloat16 x) { return BFloat16ToFloat(x); }
FSDPP_INLINE float ToFloat(Float16 x) { return Float16ToFloat(x); }

template <typename T>
FSDPP_INLINE T FromFloat(float x);
template <>
FSDPP_INLINE float FromFloat<float>(float x) {
  return x;
}
template <>
FSDPP_INLINE BFloat16 FromFloat<BFloat16>(float x) {
  return FloatToBFloat16(x);
}
template <>
FSDPP_INLINE Float16 FromFloat<Float16>(float x) {
  return FloatToFloat16(x);
}

// The DType of a C++ storage type.
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::kBF16;
};
template <>
struct DTypeOf<Float16> {
  static constexpr DType value = DType::kF16;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kI32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::kI64;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::kU8;
};

}  // namespace fsdpp

#endif  // FSDPP_CORE_DTYPE_H_
