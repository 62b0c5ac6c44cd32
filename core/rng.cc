// Bulk generation on the host; see rng.h.
#include "core/rng.h"

#include "core/logging.h"

namespace fsdpp {

void FillUniform(uint64_t seed, uint64_t stream, uint64_t offset, int64_t n,
                 float lo, float hi, float* out) {
  const float scale = hi - lo;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    out[j] = lo + scale * RandomUniform(seed, stream, offset + j);
  }
}

void FillNormal(uint64_t seed, uint64_t stream, uint64_t offset, int64_t n,
                float mean, float std, float* out) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    out[j] = mean + std * RandomNormal(seed, stream, offset + j);
  }
}

void FillTruncatedNormal(uint64_t seed, uint64_t stream, uint64_t offset,
                         int64_t n, float mean, float std, float bound,
                         float* out) {
  CHECK_GE(bound, 1.0f);
  // Retry r of element i draws from stream id (stream + r * 2^56): still a
  // pure function of (seed, stream, i). P(|z| > 1) ~ 0.32, so 64 tries fail
  // with probability < 1e-31; the last try is clamped.
  constexpr uint64_t kRetryStride = uint64_t{1} << 56;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    float z = 0.0f;
    for (int r = 0; r < 64; ++r) {
      z = RandomNormal(seed, stream + r * kRetryStride, offset + j);
      if (z >= -bound && z <= bound) break;
    }
    z = z < -bound ? -bound : (z > bound ? bound : z);
    out[j] = mean + std * z;
  }
}

}  // namespace fsdpp
