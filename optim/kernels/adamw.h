// Per-element AdamW update (and the loss scaler's gradient unscale), shared
// by the optimizer's CPU loop (optim/adamw.cc) and its CUDA kernel
// (optim/adamw_cuda.cu).
//
// The update follows torch.optim.AdamW's single-tensor path (PyTorch 1.13,
// the reference the tests run) operation by operation, with every scalar
// rounded to f32 the way torch passes Python floats to f32 kernels:
//
//   p  = p * (1 - lr * wd)                    decoupled decay, first
//   m  = m * b1 + (1 - b1) * g
//   v  = v * b2 + (1 - b2) * g * g            ((1 - b2) * g) * g
//   p  = p + (-lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//
// which is p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p_old) with
// m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t). (torch >= 2.0 writes the
// m update as lerp, m + (1 - b1) * (g - m): equal in exact arithmetic, and
// torch's vectorised CPU kernels use FMAs anyway, so torch agrees with this
// to rounding, not bit for bit.) The scalars depending on
// the step (bias corrections) are computed once per step on the host in
// double (AdamWScalars::Make), so the per-element code is only f32 multiplies,
// adds, one division and one sqrt: correctly rounded on both devices, and
// bitwise equal when neither compiler contracts a * b + c into an FMA (optim
// builds with -ffp-contract=off on the host and --fmad=false in nvcc).
#ifndef FSDPP_OPTIM_KERNELS_ADAMW_H_
#define FSDPP_OPTIM_KERNELS_ADAMW_H_

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/macros.h"

namespace fsdpp {
namespace kernels {

// The f32 scalars of one AdamW step of one tensor.
struct AdamWScalars {
  float decay = 1.0f;  // 1 - lr * weight_decay (exactly 1 without decay).
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1.0f;  // sqrt(1 - beta2^step).
  float eps = 1e-8f;
  float neg_step_size = 0.0f;  // -lr / (1 - beta1^step).
  // Each gradient is first multiplied by this (gradient clipping's
  // coefficient, fused: g * grad_scale is the product the separate scaling
  // pass would have stored; 1 leaves g as it is).
  float grad_scale = 1.0f;

  // The scalars for 1-based `step` from double hyper-parameters (host only).
  // Each is computed in double and rounded to f32 once, as torch does.
  static AdamWScalars Make(double lr, double beta1, double beta2, double eps,
                           double weight_decay, int64_t step) {
    const double t = static_cast<double>(step);
    AdamWScalars s;
    s.decay = static_cast<float>(1.0 - lr * weight_decay);
    s.beta1 = static_cast<float>(beta1);
    s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    s.beta2 = static_cast<float>(beta2);
    s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    s.bias_correction2_sqrt =
        static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
    s.eps = static_cast<float>(eps);
    s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, t))));
    return s;
  }
};

// Updates one element in place: p (f32 master), m, v from gradient g.
FSDPP_INLINE void AdamWElement(const AdamWScalars& s, float g, float* p,
                               float* m, float* v) {
  g = g * s.grad_scale;
  const float decayed = *p * s.decay;
  const float m_new = *m * s.beta1 + s.one_minus_beta1 * g;
  const float v_new = *v * s.beta2 + s.one_minus_beta2 * g * g;
  const float denom = sqrtf(v_new) / s.bias_correction2_sqrt + s.eps;
  *m = m_new;
  *v = v_new;
  *p = decayed + s.neg_step_size * m_new / denom;
}

// True for +-inf and NaN (exponent all ones), by bits, so it holds under any
// floating-point compiler flags and on both devices.
FSDPP_INLINE bool IsNonFinite(float x) {
  return (FloatBits(x) & 0x7f800000u) == 0x7f800000u;
}

// Gradient clipping's coefficient for the global gradient `norm`:
// max_norm / (norm + 1e-6) in double, rounded to f32 when below 1, else
// exactly 1 (torch.nn.utils.clip_grad_norm_'s clip_coef clamped to 1). The
// same double arithmetic on both devices, so a coefficient the GPU computes
// from the norm it holds equals the host's bit for bit.
FSDPP_INLINE float ClipCoefficient(double norm, double max_norm) {
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

// A step decided where its values are (optim/adamw.h, AdamW::StepGuard):
// false when the step's `loss` or squared global gradient norm `norm_sq` is
// not finite (nothing is updated), else true with *grad_scale the clip
// coefficient of sqrt(norm_sq) for max_norm > 0, or 1 without clipping.
FSDPP_INLINE bool GuardedGradScale(float loss, float norm_sq, double max_norm,
                                   float* grad_scale) {
  if (IsNonFinite(loss) || IsNonFinite(norm_sq)) return false;
  *grad_scale =
      max_norm > 0.0
          ? ClipCoefficient(sqrt(static_cast<double>(norm_sq)), max_norm)
          : 1.0f;
  return true;
}

// The loss scaler's unscale: returns g * inv_scale and sets *found_non_finite
// when g itself is inf or NaN (the check runs on the scaled value, as torch's
// _amp_foreach_non_finite_check_and_unscale_ does).
FSDPP_INLINE float UnscaleElement(float g, float inv_scale,
                                  bool* found_non_finite) {
  if (IsNonFinite(g)) *found_non_finite = true;
  return g * inv_scale;
}

}  // namespace kernels
}  // namespace fsdpp

#endif  // FSDPP_OPTIM_KERNELS_ADAMW_H_
