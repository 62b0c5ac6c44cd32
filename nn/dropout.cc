// Keyed dropout; see dropout.h.
#include "nn/dropout.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/rng.h"

namespace fsdpp {
namespace nn {
namespace {

thread_local const DropoutRows* active_rows = nullptr;

// Applies the mask to the b x t rows of f features of `in` into `out`
// (either dtype's values through `load` / `store`); the rows in parallel,
// each Philox block (4 consecutive elements) computed once.
template <typename T, typename Load, typename Store>
void Apply(const T* in, T* out, int64_t b, int64_t t, int64_t f, float p,
           float scale, uint64_t layer_key, int64_t feature_offset,
           int64_t features, const DropoutRows& rows, Load load, Store store) {
  const int64_t n = b * t;
#pragma omp parallel for schedule(static) if (n * f > (1 << 15))
  for (int64_t bt = 0; bt < n; ++bt) {
    const uint64_t stream = rows.keys[bt / t];
    const uint64_t base = static_cast<uint64_t>(rows.columns[bt % t]) *
                              static_cast<uint64_t>(features) +
                          static_cast<uint64_t>(feature_offset);
    const int64_t at = bt * f;
    Philox4x32 block = {{0, 0, 0, 0}};
    uint64_t current = ~uint64_t{0};
    for (int64_t j = 0; j < f; ++j) {
      const uint64_t i = base + static_cast<uint64_t>(j);
      if (i / 4 != current) {
        current = i / 4;
        block = PhiloxBlock(layer_key, stream, current);
      }
      const bool keep = UniformFromBits(block.v[i % 4]) >= p;
      out[at + j] = store(keep ? load(in[at + j]) * scale : 0.0f);
    }
  }
}

}  // namespace

const DropoutRows* DropoutRows::Active() { return active_rows; }

DropoutRows::Scope::Scope(const DropoutRows* rows) : previous_(active_rows) {
  active_rows = rows;
}

DropoutRows::Scope::~Scope() { active_rows = previous_; }

absl::Status KeyedDropout(const Tensor& x, float p, uint64_t layer_key,
                          int64_t feature_offset, int64_t features,
                          const DropoutRows& rows, Tensor* out) {
  if (!(p >= 0.0f && p < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dropout: p must be in [0, 1), got ", p));
  }
  if (out == nullptr || !x.defined() || x.ndim() != 3 ||
      x.dim(0) != static_cast<int64_t>(rows.keys.size()) ||
      x.dim(1) != static_cast<int64_t>(rows.columns.size()) ||
      feature_offset < 0 || feature_offset + x.dim(2) > features ||
      !out->defined() || out->shape() != x.shape() ||
      out->dtype() != x.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dropout: input ", x.ToString(), " must be [", rows.keys.size(), ", ",
        rows.columns.size(),
        ", F] (the batch's rows and tokens) with features ", feature_offset,
        " + F <= ", features, ", and the output like it"));
  }
  if (x.is_meta()) return absl::OkStatus();
  if (!x.device().is_cpu() || !out->device().is_cpu()) {
    return absl::UnimplementedError(absl::StrCat(
        "dropout: keyed dropout runs on the CPU, not ", x.device().ToString()));
  }
  const float scale = 1.0f / (1.0f - p);
  const int64_t b = x.dim(0), t = x.dim(1), f = x.dim(2);
  switch (x.dtype()) {
    case DType::kF32:
      Apply(
          x.data<float>(), out->data<float>(), b, t, f, p, scale, layer_key,
          feature_offset, features, rows, [](float v) { return v; },
          [](float v) { return v; });
      return absl::OkStatus();
    case DType::kBF16:
      Apply(
          x.data<BFloat16>(), out->data<BFloat16>(), b, t, f, p, scale,
          layer_key, feature_offset, features, rows,
          [](BFloat16 v) { return BFloat16ToFloat(v); },
          [](float v) { return FloatToBFloat16(v); });
      return absl::OkStatus();
    default:
      return absl::UnimplementedError(absl::StrCat(
          "dropout: ", DTypeName(x.dtype()), " inputs (f32 or bf16 only)"));
  }
}

}  // namespace nn
}  // namespace fsdpp
