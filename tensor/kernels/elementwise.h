// Elementwise math shared by the CPU loops and the CUDA kernels.
//
// Each operation is a functor on float (storage types convert through
// ToFloat / FromFloat), marked FSDPP_HOST_DEVICE so tensor/cpu and tensor/cuda
// compute exactly the same expressions.
#ifndef FSDPP_TENSOR_KERNELS_ELEMENTWISE_H_
#define FSDPP_TENSOR_KERNELS_ELEMENTWISE_H_

#include <cmath>

#include "core/macros.h"

namespace fsdpp {
namespace kernels {

struct AddOp {
  FSDPP_INLINE float operator()(float a, float b) const { return a + b; }
};

struct MulOp {
  FSDPP_INLINE float operator()(float a, float b) const { return a * b; }
};

// y = alpha * x.
struct ScaleOp {
  float alpha;
  FSDPP_INLINE float operator()(float x) const { return alpha * x; }
};

// y = y + alpha * x.
struct AxpyOp {
  float alpha;
  FSDPP_INLINE float operator()(float y, float x) const {
    return y + alpha * x;
  }
};

// sqrt(2 / pi) and the cubic coefficient of the tanh GELU approximation.
constexpr float kGeluScale = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(s (x + c x^3))).
struct GeluOp {
  FSDPP_INLINE float operator()(float x) const {
    const float inner = kGeluScale * (x + kGeluCubic * x * x * x);
    return 0.5f * x * (1.0f + tanhf(inner));
  }
};

// dx = dy * d/dx GELU(x).
struct GeluBackwardOp {
  FSDPP_INLINE float operator()(float x, float dy) const {
    const float x2 = x * x;
    const float inner = kGeluScale * (x + kGeluCubic * x2 * x);
    const float t = tanhf(inner);
    const float sech2 = 1.0f - t * t;
    const float dinner = kGeluScale * (1.0f + 3.0f * kGeluCubic * x2);
    return dy * (0.5f * (1.0f + t) + 0.5f * x * sech2 * dinner);
  }
};

FSDPP_INLINE float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// SiLU (swish): x * sigmoid(x).
struct SiluOp {
  FSDPP_INLINE float operator()(float x) const { return x * Sigmoid(x); }
};

// dx = dy * sigmoid(x) * (1 + x * (1 - sigmoid(x))).
struct SiluBackwardOp {
  FSDPP_INLINE float operator()(float x, float dy) const {
    const float s = Sigmoid(x);
    return dy * s * (1.0f + x * (1.0f - s));
  }
};

}  // namespace kernels
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_KERNELS_ELEMENTWISE_H_
