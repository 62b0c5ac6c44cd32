// DType names; see dtype.h.
#include "core/dtype.h"

#include "absl/strings/str_cat.h"

namespace fsdpp {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kU8:
      return "u8";
  }
  return "?";
}

namespace {

// Elements of `data` (unsigned words) whose exponent field, `mask`, is all
// ones.
template <typename Word>
int64_t CountExponentAllOnes(const void* data, int64_t count, Word mask) {
  const Word* w = static_cast<const Word*>(data);
  int64_t n = 0;
  for (int64_t i = 0; i < count; ++i) n += (w[i] & mask) == mask;
  return n;
}

}  // namespace

int64_t CountNonFinite(const void* data, int64_t count, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return CountExponentAllOnes<uint32_t>(data, count, 0x7f800000u);
    case DType::kBF16:
      return CountExponentAllOnes<uint16_t>(data, count, 0x7f80u);
    case DType::kF16:
      return CountExponentAllOnes<uint16_t>(data, count, 0x7c00u);
    case DType::kI32:
    case DType::kI64:
    case DType::kU8:
      return 0;
  }
  return 0;
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  struct Entry {
    const char* short_name;
    const char* long_name;
    DType dtype;
  };
  static constexpr Entry kEntries[] = {
      {"f32", "float32", DType::kF32}, {"bf16", "bfloat16", DType::kBF16},
      {"f16", "float16", DType::kF16}, {"i32", "int32", DType::kI32},
      {"i64", "int64", DType::kI64},   {"u8", "uint8", DType::kU8},
  };
  for (const Entry& e : kEntries) {
    if (name == e.short_name || name == e.long_name) return e.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name,
                   "' (expected one of f32, bf16, f16, i32, i64, u8)"));
}

}  // namespace fsdpp
