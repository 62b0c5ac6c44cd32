// Test helpers for the Highway kernels (simd_test, rowwise_test): running a
// test once per Highway target the CPU supports, and buffers of any float
// dtype that start at an unaligned offset.
#ifndef FSDPP_TENSOR_CPU_SIMD_TESTING_H_
#define FSDPP_TENSOR_CPU_SIMD_TESTING_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "hwy/targets.h"

namespace fsdpp {
namespace cpu {
namespace testing_util {

inline constexpr DType kFloatTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// Restricts dispatch to one target at a time; restores all on destruction.
class EachTarget {
 public:
  EachTarget() : targets_(hwy::SupportedAndGeneratedTargets()) {}
  ~EachTarget() { hwy::SetSupportedTargetsForTest(0); }
  const std::vector<int64_t>& targets() const { return targets_; }

 private:
  std::vector<int64_t> targets_;
};

// A buffer of `n` elements of `dtype` holding `values` (rounded), starting
// `offset` elements into its storage (unaligned starts).
struct Buffer {
  Buffer(DType dtype, const std::vector<float>& values, int64_t offset)
      : dtype(dtype),
        offset(offset),
        bytes((values.size() + offset + 1) * DTypeSize(dtype), 0xAB) {
    for (size_t i = 0; i < values.size(); ++i) Set(i, values[i]);
  }
  void* data() { return bytes.data() + offset * DTypeSize(dtype); }
  void Set(size_t i, float v) {
    char* p = static_cast<char*>(data()) + i * DTypeSize(dtype);
    if (dtype == DType::kF32) {
      std::memcpy(p, &v, 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? FloatToBFloat16(v).bits
                                               : FloatToFloat16(v).bits;
      std::memcpy(p, &h, 2);
    }
  }
  float Get(size_t i) {
    const char* p = static_cast<const char*>(data()) + i * DTypeSize(dtype);
    if (dtype == DType::kF32) {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return dtype == DType::kBF16 ? BFloat16ToFloat(BFloat16::FromBits(h))
                                 : Float16ToFloat(Float16::FromBits(h));
  }
  DType dtype;
  int64_t offset;
  std::vector<char> bytes;
};

// The stored bits of element i, for bitwise comparisons.
inline uint32_t Bits(Buffer& b, size_t i) {
  const char* p = static_cast<const char*>(b.data()) + i * DTypeSize(b.dtype);
  uint32_t bits = 0;
  std::memcpy(&bits, p, DTypeSize(b.dtype));
  return bits;
}

inline std::string Where(int64_t target, DType dtype, int64_t n,
                         int64_t offset) {
  return absl::StrCat(hwy::TargetName(target), " ", DTypeName(dtype), " n=", n,
                      " offset=", offset);
}

}  // namespace testing_util
}  // namespace cpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CPU_SIMD_TESTING_H_
