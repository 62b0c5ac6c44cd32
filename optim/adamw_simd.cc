// Highway AdamW kernel behind adamw_simd.h, compiled once per target.
#include "optim/adamw_simd.h"

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "optim/kernels/adamw.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "optim/adamw_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "tensor/cpu/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fsdpp {
namespace adamw_simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using simd_convert::HWY_NAMESPACE::DF;
using simd_convert::HWY_NAMESPACE::StoreF;

// The update of kernels::AdamWElement, operation by operation.
template <typename C>
HWY_INLINE void StepLoop(const kernels::AdamWScalars& s, const float* grad,
                         float* param, float* exp_avg, float* exp_avg_sq,
                         C* copy, size_t n) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  const auto decay = hn::Set(d, s.decay);
  const auto beta1 = hn::Set(d, s.beta1);
  const auto one_minus_beta1 = hn::Set(d, s.one_minus_beta1);
  const auto beta2 = hn::Set(d, s.beta2);
  const auto one_minus_beta2 = hn::Set(d, s.one_minus_beta2);
  const auto bias_correction2_sqrt = hn::Set(d, s.bias_correction2_sqrt);
  const auto eps = hn::Set(d, s.eps);
  const auto neg_step_size = hn::Set(d, s.neg_step_size);
  const auto grad_scale = hn::Set(d, s.grad_scale);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto g = hn::Mul(hn::LoadU(d, grad + i), grad_scale);
    const auto decayed = hn::Mul(hn::LoadU(d, param + i), decay);
    const auto m = hn::Add(hn::Mul(hn::LoadU(d, exp_avg + i), beta1),
                           hn::Mul(one_minus_beta1, g));
    const auto v = hn::Add(hn::Mul(hn::LoadU(d, exp_avg_sq + i), beta2),
                           hn::Mul(hn::Mul(one_minus_beta2, g), g));
    const auto denom =
        hn::Add(hn::Div(hn::Sqrt(v), bias_correction2_sqrt), eps);
    const auto p = hn::Add(decayed, hn::Div(hn::Mul(neg_step_size, m), denom));
    hn::StoreU(m, d, exp_avg + i);
    hn::StoreU(v, d, exp_avg_sq + i);
    hn::StoreU(p, d, param + i);
    if (copy != nullptr) StoreF(d, p, copy + i);
  }
  for (; i < n; ++i) {
    kernels::AdamWElement(s, grad[i], param + i, exp_avg + i, exp_avg_sq + i);
    if (copy != nullptr) copy[i] = FromFloat<C>(param[i]);
  }
}

void StepF32(const kernels::AdamWScalars& s, const float* grad, float* param,
             float* m, float* v, void* copy, size_t n) {
  StepLoop(s, grad, param, m, v, static_cast<float*>(copy), n);
}
void StepBf16(const kernels::AdamWScalars& s, const float* grad, float* param,
              float* m, float* v, void* copy, size_t n) {
  StepLoop(s, grad, param, m, v, static_cast<BFloat16*>(copy), n);
}
void StepF16(const kernels::AdamWScalars& s, const float* grad, float* param,
             float* m, float* v, void* copy, size_t n) {
  StepLoop(s, grad, param, m, v, static_cast<Float16*>(copy), n);
}

}  // namespace HWY_NAMESPACE
}  // namespace adamw_simd
}  // namespace fsdpp
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fsdpp {
namespace adamw_simd {

HWY_EXPORT(StepF32);
HWY_EXPORT(StepBf16);
HWY_EXPORT(StepF16);

void Step(const kernels::AdamWScalars& s, const float* grad, float* param,
          float* exp_avg, float* exp_avg_sq, DType copy_dtype, void* copy,
          int64_t n) {
  const size_t count = static_cast<size_t>(n);
  if (copy != nullptr && copy_dtype == DType::kBF16) {
    HWY_DYNAMIC_DISPATCH(StepBf16)
    (s, grad, param, exp_avg, exp_avg_sq, copy, count);
  } else if (copy != nullptr && copy_dtype == DType::kF16) {
    HWY_DYNAMIC_DISPATCH(StepF16)
    (s, grad, param, exp_avg, exp_avg_sq, copy, count);
  } else {
    HWY_DYNAMIC_DISPATCH(StepF32)
    (s, grad, param, exp_avg, exp_avg_sq, copy, count);
  }
}

}  // namespace adamw_simd
}  // namespace fsdpp
#endif  // HWY_ONCE
