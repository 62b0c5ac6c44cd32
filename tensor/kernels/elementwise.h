// Elementwise math shared by the CPU loops and the CUDA kernels.
//
// Each operation is a functor on float (storage types convert through
// ToFloat / FromFloat), marked FSDPP_HOST_DEVICE so tensor/cpu and tensor/cuda
// compute exactly the same expressions.
#ifndef FSDPP_TENSOR_KERNELS_ELEMENTWISE_H_
#define FSDPP_TENSOR_KERNELS_ELEMENTWISE_H_

#include <cmath>
#include <cstdint>
#include <cstring>

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

// exp and tanh for the activation functions, written with plain float
// operations (no libm call, and no fused multiply-add in the CPU builds:
// tensor/cpu compiles with -ffp-contract=off), so that the vectorised CPU
// kernels (tensor/cpu/simd.cc) compute them bit for bit as these scalar
// functions do, on every SIMD target. CUDA builds may contract to FMA and
// differ from the CPU in the last bit.
//
// ExpApprox: exp(x) = 2^k exp(r), k = floor(x log2(e) + 1/2), r = x - k ln 2
// with ln 2 in two parts (Cody and Waite), exp(r) on [-ln2/2, ln2/2] by the
// degree-7 polynomial 1 + r + r^2 P(r) of Cephes' expf. Measured against
// double exp on a dense sweep of [-87.3, 88.3] (tensor/cpu/simd_test.cc):
// relative error 7.9e-8 (under 1 ulp; bound checked: 1e-7). x > kExpHi gives
// +inf (exp is still finite up to 88.72: the last 0.35 is given up so that 2^k
// is a normal float), x < kExpLo gives +0 (no subnormal results), NaN gives
// NaN.
constexpr float kExpHi = 88.3f;
constexpr float kExpLo = -87.3f;

FSDPP_INLINE float ExpApprox(float x) {
  if (!(x == x)) return x;  // NaN
  if (x > kExpHi) return INFINITY;
  if (x < kExpLo) return 0.0f;
  const float k = floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - k * 0.693359375f;  // ln 2, high part (exact in 9 bits)
  r = r - k * -2.12194440e-4f;     // ln 2 - high part
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  // 2^k through the exponent bits (k in [-126, 127] by the bounds above).
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)). Measured absolute error
// 1.1e-7 (1 ulp of 1; bound checked: 1.5e-7) over [-20, 20]; |x| > 44.15
// gives exactly +-1. GELU (through ExpApprox, see GeluOp) and SiLU: error
// 1.2e-7 and 1.4e-7 times |x| against the double tanh / exp forms (bound
// checked: 2e-7 |x|); the libm tanhf / expf they replace are within about 1
// ulp too. GELU's derivative uses this tanh; its error is absolute, not
// relative, near 0 (where tanh(x) ~ x), which is what 1 + tanh needs.
FSDPP_INLINE float TanhApprox(float x) {
  const float e = ExpApprox(2.0f * fabsf(x));
  return copysignf(1.0f - 2.0f / (e + 1.0f), x);
}

// The activations return any NaN as the positive quiet NaN: which of two
// NaN operands an IEEE operation returns is up to the hardware and to the
// compiler's operand order, and the vector kernels must match bit for bit.
FSDPP_INLINE float QuietNan(float r) { return r == r ? r : NAN; }

// sqrt(2 / pi) and the cubic coefficient of the tanh GELU approximation.
constexpr float kGeluScale = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(u)), u = s (x + c x^3),
// computed as the equal x / (1 + exp(-2 u)): one exp and one division, and
// no cancellation in 1 + tanh(u) for negative x (where 0.5 x (1 + tanh(u))
// keeps an absolute error of ~1e-7 |x| while GELU's value is far smaller).
struct GeluOp {
  FSDPP_INLINE float operator()(float x) const {
    const float inner = kGeluScale * (x + kGeluCubic * x * x * x);
    return QuietNan(x / (1.0f + ExpApprox(-2.0f * inner)));
  }
};

// d/dx GELU(x).
FSDPP_INLINE float GeluGrad(float x) {
  const float x2 = x * x;
  const float inner = kGeluScale * (x + kGeluCubic * x2 * x);
  const float t = TanhApprox(inner);
  const float sech2 = 1.0f - t * t;
  const float dinner = kGeluScale * (1.0f + 3.0f * kGeluCubic * x2);
  return 0.5f * (1.0f + t) + 0.5f * x * sech2 * dinner;
}

// dx = dy * d/dx GELU(x): one product with a function of x alone, so the
// CPU kernels of the 16-bit types look the derivative up in a table.
struct GeluBackwardOp {
  FSDPP_INLINE float operator()(float x, float dy) const {
    return QuietNan(dy * GeluGrad(x));
  }
};

FSDPP_INLINE float Sigmoid(float x) { return 1.0f / (1.0f + ExpApprox(-x)); }

// SiLU (swish): x * sigmoid(x).
struct SiluOp {
  FSDPP_INLINE float operator()(float x) const {
    return QuietNan(x * Sigmoid(x));
  }
};

// d/dx SiLU(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x))).
FSDPP_INLINE float SiluGrad(float x) {
  const float s = Sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// dx = dy * d/dx SiLU(x), a product as GeluBackwardOp's.
struct SiluBackwardOp {
  FSDPP_INLINE float operator()(float x, float dy) const {
    return QuietNan(dy * SiluGrad(x));
  }
};

}  // namespace kernels
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_KERNELS_ELEMENTWISE_H_
