// Test helpers; see testing.h.
#include "tensor/test_tensors.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/rng.h"

namespace fsdpp {
namespace testing_util {

Tensor RandomTensor(const Shape& shape, DType dtype, uint64_t seed, float lo,
                    float hi) {
  std::vector<float> v(NumElements(shape));
  FillUniform(seed, 0, 0, static_cast<int64_t>(v.size()), lo, hi, v.data());
  absl::StatusOr<Tensor> t = Tensor::FromFloats(shape, v, dtype);
  CHECK_OK(t.status());
  return *std::move(t);
}

std::vector<double> Values(const Tensor& t) {
  absl::StatusOr<std::vector<float>> f = t.ToFloats();
  CHECK_OK(f.status());
  return std::vector<double>(f->begin(), f->end());
}

::testing::AssertionResult AllClose(const std::vector<double>& actual,
                                    const std::vector<double>& expected,
                                    double rtol, double atol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "sizes differ: " << actual.size() << " vs " << expected.size();
  }
  double worst = 0.0;
  size_t worst_i = 0;
  size_t bad = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] == expected[i]) continue;  // equal infinities too
    const double err = std::fabs(actual[i] - expected[i]);
    const double allowed = atol + rtol * std::fabs(expected[i]);
    if (!(err <= allowed)) {
      ++bad;
      const double excess = std::isnan(err) ? INFINITY : err / allowed;
      if (excess > worst || bad == 1) {
        worst = excess;
        worst_i = i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << actual.size() << " elements differ; worst at "
         << worst_i << ": actual " << actual[worst_i] << " expected "
         << expected[worst_i] << " (rtol " << rtol << ", atol " << atol << ")";
}

double RelTol(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 1.0 / 128;  // Two bf16 roundings (2^-8 each).
    case DType::kF16:
      return 1.0 / 1024;
    default:
      return 2e-5;
  }
}

bool BitwiseEqual(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 ||
          std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0);
}

Tensor GatherRows(const Tensor& x, const std::vector<int64_t>& rows) {
  const int64_t b = x.dim(0), n = x.dim(1), t = x.dim(2), hd = x.dim(3);
  const int64_t m = static_cast<int64_t>(rows.size());
  const int64_t row = hd * static_cast<int64_t>(DTypeSize(x.dtype()));
  absl::StatusOr<Tensor> out =
      Tensor::Empty({b, n, m, hd}, x.dtype(), Device::Cpu());
  EXPECT_TRUE(out.ok()) << out.status();
  const char* src = static_cast<const char*>(x.raw_data());
  char* dst = static_cast<char*>(out->raw_data());
  for (int64_t bn = 0; bn < b * n; ++bn) {
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(dst + (bn * m + i) * row, src + (bn * t + rows[i]) * row,
                  row);
    }
  }
  return *std::move(out);
}

Tensor PackedDocumentIds(int64_t b, int64_t t) {
  std::vector<int64_t> ids(b * t, 1);
  uint64_t x = 3;
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t i = 0; i < t;) {
      ids[r * t + i] = 0;  // end-of-text: a document begins
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      i += 7 + static_cast<int64_t>((x >> 33) % 34);
    }
  }
  absl::StatusOr<Tensor> out = Tensor::FromInts({b, t}, ids, DType::kI32);
  CHECK_OK(out.status());
  return *out;
}

}  // namespace testing_util
}  // namespace fsdpp
