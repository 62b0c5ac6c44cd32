// Rotary position embedding (RoPE) math shared by host loops and CUDA kernels.
//
// Convention: Hugging Face Llama's rotate_half (also GPT-NeoX): a head row of
// head_dim elements is split into a first and a second half, and element i is
// rotated together with element i + head_dim / 2 (not with its neighbour
// 2i + 1 as in Meta's original complex-number code) by the angle
// position * theta^(-2i / head_dim). The angle is computed in f32 exactly as
// HF computes inv_freq and freqs, so parity tests against HF-style PyTorch
// code agree to f32 rounding. The rotation is orthogonal, so the backward pass
// is the inverse rotation (the same angles, negated). Every function reads
// both elements of a pair before writing either, so `y` / `dx` may alias the
// input (in-place rotation).
#ifndef FSDPP_TENSOR_KERNELS_ROPE_H_
#define FSDPP_TENSOR_KERNELS_ROPE_H_

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/macros.h"

namespace fsdpp {
namespace kernels {

// Angle of pair i (0 <= i < head_dim / 2) at `position`:
// position * (1 / theta^(2i / head_dim)), in f32 like HF's inv_freq.
FSDPP_INLINE float RopeAngle(int64_t position, int64_t i, float theta,
                             int64_t head_dim) {
  const float exponent =
      static_cast<float>(2 * i) / static_cast<float>(head_dim);
  const float inv_freq = 1.0f / powf(theta, exponent);
  return static_cast<float>(position) * inv_freq;
}

// y = RoPE(x) for one head row of `head_dim` (even) elements:
//   y[i]        = x[i] cos - x[i + h] sin
//   y[i + h]    = x[i + h] cos + x[i] sin,      h = head_dim / 2.
template <typename T>
FSDPP_INLINE void RopeRowForward(const T* x, int64_t position, float theta,
                                 int64_t head_dim, T* y) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = RopeAngle(position, i, theta, head_dim);
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
FSDPP_INLINE void RopeRowBackward(const T* dy, int64_t position, float theta,
                                  int64_t head_dim, T* dx) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = RopeAngle(position, i, theta, head_dim);
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
