// Rotary position embedding (RoPE) math shared by host loops and CUDA kernels.
//
// Convention: Hugging Face Llama's rotate_half (also GPT-NeoX): a head row of
// head_dim elements is split into a first and a second half, and element i is
// rotated together with element i + head_dim / 2 (not with its neighbour
// 2i + 1 as in Meta's original complex-number code) by the angle
// position * theta^(-2i / head_dim) (optionally with Llama 3's frequency
// scaling). The angle is computed in f32 exactly as HF computes inv_freq and
// freqs, so parity tests against HF-style PyTorch code agree to f32
// rounding. The rotation is orthogonal, so the backward pass
// is the inverse rotation (the same angles, negated). Every function reads
// both elements of a pair before writing either, so `y` / `dx` may alias the
// input (in-place rotation).
#ifndef FSDPP_TENSOR_KERNELS_ROPE_H_
#define FSDPP_TENSOR_KERNELS_ROPE_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/macros.h"

namespace fsdpp {
namespace kernels {

// Llama 3.1 / 3.2's frequency scaling (Hugging Face rope_scaling with
// rope_type "llama3"), which stretches the long wavelengths so a model
// trained at `original_context` positions works at longer ones: a pair whose
// wavelength 2 pi / inv_freq is longer than original_context /
// low_freq_factor turns factor times slower; one shorter than
// original_context / high_freq_factor is kept; in between, inv_freq is
// interpolated between the two by s = (original_context / wavelength -
// low_freq_factor) / (high_freq_factor - low_freq_factor). factor = 0 means
// no scaling (rope_type "default"). Llama-3.2-1B: factor 32, low 1, high 4,
// original 8192; Llama-3.1-8B: factor 8.
struct RopeScaling {
  float factor = 0.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  float original_context = 8192.0f;
  FSDPP_INLINE bool enabled() const { return factor > 0.0f; }
};

// Null when `scaling` is usable (disabled, or factor >= 1, 0 <
// low_freq_factor < high_freq_factor, original_context > 0); otherwise what
// is wrong, for the config validators' messages.
inline const char* RopeScalingProblem(const RopeScaling& scaling) {
  if (scaling.factor == 0.0f) return nullptr;
  if (!(scaling.factor >= 1.0f)) return "rope_scaling.factor must be >= 1";
  if (!(scaling.low_freq_factor > 0.0f) ||
      !(scaling.low_freq_factor < scaling.high_freq_factor)) {
    return "rope_scaling needs 0 < low_freq_factor < high_freq_factor";
  }
  if (!(scaling.original_context > 0.0f)) {
    return "rope_scaling.original_context must be positive";
  }
  return nullptr;
}

// Inverse frequency of pair i (0 <= i < head_dim / 2): 1 / theta^(2i /
// head_dim), in f32 like HF's inv_freq, then `scaling` when enabled (also in
// f32, as HF computes it). Callers build the head_dim / 2 table once.
FSDPP_INLINE float RopeInvFreq(int64_t i, float theta, int64_t head_dim,
                               const RopeScaling& scaling) {
  const float exponent =
      static_cast<float>(2 * i) / static_cast<float>(head_dim);
  const float inv_freq = 1.0f / powf(theta, exponent);
  if (!scaling.enabled()) return inv_freq;
  const float wavelength = 6.283185307179586f / inv_freq;
  if (wavelength < scaling.original_context / scaling.high_freq_factor) {
    return inv_freq;
  }
  if (wavelength > scaling.original_context / scaling.low_freq_factor) {
    return inv_freq / scaling.factor;
  }
  const float s =
      (scaling.original_context / wavelength - scaling.low_freq_factor) /
      (scaling.high_freq_factor - scaling.low_freq_factor);
  return (1.0f - s) * inv_freq / scaling.factor + s * inv_freq;
}

// The head_dim / 2 inverse frequencies of a head row, built once per call
// of the row functions below.
inline std::vector<float> RopeInvFreqs(float theta, int64_t head_dim,
                                       const RopeScaling& scaling) {
  std::vector<float> table(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    table[i] = RopeInvFreq(i, theta, head_dim, scaling);
  }
  return table;
}

// y = RoPE(x) for one head row of `head_dim` (even) elements, with the
// angle of pair i = position * inv_freq[i] (f32, like HF's freqs):
//   y[i]        = x[i] cos - x[i + h] sin
//   y[i + h]    = x[i + h] cos + x[i] sin,      h = head_dim / 2.
template <typename T>
FSDPP_INLINE void RopeRowForward(const T* x, int64_t position,
                                 const float* inv_freq, int64_t head_dim,
                                 T* y) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq[i];
    const float c = cosf(angle);
    const float s = sinf(angle);
    const float a = ToFloat(x[i]);
    const float b = ToFloat(x[i + half]);
    y[i] = FromFloat<T>(a * c - b * s);
    y[i + half] = FromFloat<T>(b * c + a * s);
  }
}

// dx = RoPE^T(dy) = the inverse rotation of one row:
//   dx[i]       = dy[i] cos + dy[i + h] sin
//   dx[i + h]   = dy[i + h] cos - dy[i] sin.
template <typename T>
FSDPP_INLINE void RopeRowBackward(const T* dy, int64_t position,
                                  const float* inv_freq, int64_t head_dim,
                                  T* dx) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq[i];
    const float c = cosf(angle);
    const float s = sinf(angle);
    const float a = ToFloat(dy[i]);
    const float b = ToFloat(dy[i + half]);
    dx[i] = FromFloat<T>(a * c + b * s);
    dx[i + half] = FromFloat<T>(b * c - a * s);
  }
}

}  // namespace kernels
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_KERNELS_ROPE_H_
