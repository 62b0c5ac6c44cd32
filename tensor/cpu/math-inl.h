// Per-target vector math shared by the Highway kernels (tensor/cpu/simd.cc,
// tensor/cpu/attention.cc): Exp computes kernels::ExpApprox
// (tensor/kernels/elementwise.h) operation for operation, so a file built
// with -ffp-contract=off gets it bit for bit. Highway's -inl.h convention:
// include it after hwy/highway.h from a file that goes through
// hwy/foreach_target.h.
#if defined(FSDPP_TENSOR_CPU_MATH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FSDPP_TENSOR_CPU_MATH_INL_H_
#undef FSDPP_TENSOR_CPU_MATH_INL_H_
#else
#define FSDPP_TENSOR_CPU_MATH_INL_H_
#endif

#include "hwy/highway.h"
#include "tensor/kernels/elementwise.h"

HWY_BEFORE_NAMESPACE();
namespace fsdpp {
namespace simd_math {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// kernels::ExpApprox, operation for operation.
HWY_INLINE VF Exp(DF d, VF x) {
  const VF hi = hn::Set(d, kernels::kExpHi);
  const VF lo = hn::Set(d, kernels::kExpLo);
  const VF xc = hn::Min(hn::Max(x, lo), hi);
  const VF k = hn::Floor(
      hn::Add(hn::Mul(xc, hn::Set(d, 1.44269504088896341f)), hn::Set(d, 0.5f)));
  VF r = hn::Sub(xc, hn::Mul(k, hn::Set(d, 0.693359375f)));
  r = hn::Sub(r, hn::Mul(k, hn::Set(d, -2.12194440e-4f)));
  VF p = hn::Set(d, 1.9875691500e-4f);
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 1.3981999507e-3f));
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 8.3334519073e-3f));
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 4.1665795894e-2f));
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 1.6666665459e-1f));
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 5.0000001201e-1f));
  const VF y = hn::Add(hn::Add(hn::Mul(p, hn::Mul(r, r)), r), hn::Set(d, 1.0f));
  const hn::RebindToSigned<DF> di;
  const auto bits =
      hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, k), hn::Set(di, 127)));
  VF e = hn::Mul(y, hn::BitCast(d, bits));
  e = hn::IfThenElse(hn::Gt(x, hi), hn::Inf(d), e);
  e = hn::IfThenElse(hn::Lt(x, lo), hn::Zero(d), e);
  return hn::IfThenElse(hn::IsNaN(x), x, e);
}

}  // namespace HWY_NAMESPACE
}  // namespace simd_math
}  // namespace fsdpp
HWY_AFTER_NAMESPACE();

#endif  // FSDPP_TENSOR_CPU_MATH_INL_H_
