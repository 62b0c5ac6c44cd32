// Highway kernels behind simd.h, compiled once per target by
// hwy/foreach_target.h (this file includes itself through it) and chosen at
// run time by HWY_DYNAMIC_DISPATCH. Build with -ffp-contract=off (BUILD):
// a fused multiply-add would round differently from the scalar reference.
#include "tensor/cpu/simd.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "tensor/kernels/elementwise.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tensor/cpu/simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "tensor/cpu/convert-inl.h"
#include "tensor/cpu/math-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fsdpp {
namespace cpu {
namespace simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using simd_convert::HWY_NAMESPACE::DF;
using simd_convert::HWY_NAMESPACE::LoadF;
using simd_convert::HWY_NAMESPACE::StoreF;
using VF = hn::Vec<DF>;
using simd_math::HWY_NAMESPACE::Exp;

// out[i] = op(a[i], b[i]) through f32; the tail runs the scalar functor.
template <typename T, class VectorOp, class ScalarOp>
HWY_INLINE void BinaryLoop(const void* a_raw, const void* b_raw, void* out_raw,
                           size_t n, VectorOp vector_op, ScalarOp scalar_op) {
  const T* a = static_cast<const T*>(a_raw);
  const T* b = static_cast<const T*>(b_raw);
  T* out = static_cast<T*>(out_raw);
  const DF d;
  const size_t lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    StoreF(d, vector_op(d, LoadF(d, a + i), LoadF(d, b + i)), out + i);
  }
  for (; i < n; ++i) {
    out[i] = FromFloat<T>(scalar_op(ToFloat(a[i]), ToFloat(b[i])));
  }
}

// out[i] = op(x[i]) through f32; the tail runs the scalar functor.
template <typename T, class VectorOp, class ScalarOp>
HWY_INLINE void UnaryLoop(const void* x_raw, void* out_raw, size_t n,
                          VectorOp vector_op, ScalarOp scalar_op) {
  const T* x = static_cast<const T*>(x_raw);
  T* out = static_cast<T*>(out_raw);
  const DF d;
  const size_t lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    StoreF(d, vector_op(d, LoadF(d, x + i)), out + i);
  }
  for (; i < n; ++i) out[i] = FromFloat<T>(scalar_op(ToFloat(x[i])));
}

template <typename S, typename D>
HWY_INLINE void CastLoop(const void* src_raw, void* dst_raw, size_t n) {
  const S* src = static_cast<const S*>(src_raw);
  D* dst = static_cast<D*>(dst_raw);
  const DF d;
  const size_t lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) StoreF(d, LoadF(d, src + i), dst + i);
  for (; i < n; ++i) dst[i] = FromFloat<D>(ToFloat(src[i]));
}

struct VectorAdd {
  HWY_INLINE VF operator()(DF, VF a, VF b) const { return hn::Add(a, b); }
};
struct VectorMul {
  HWY_INLINE VF operator()(DF, VF a, VF b) const { return hn::Mul(a, b); }
};
// y + alpha * x: a multiply, then an add (no FMA), as kernels::AxpyOp.
struct VectorAxpy {
  float alpha;
  HWY_INLINE VF operator()(DF d, VF y, VF x) const {
    return hn::Add(y, hn::Mul(hn::Set(d, alpha), x));
  }
};
// alpha * x, as kernels::ScaleOp (the second operand is ignored).
struct VectorScale {
  float alpha;
  HWY_INLINE VF operator()(DF d, VF x, VF) const {
    return hn::Mul(hn::Set(d, alpha), x);
  }
};
struct ScalarScale {
  float alpha;
  float operator()(float x, float) const { return kernels::ScaleOp{alpha}(x); }
};

// kernels::TanhApprox.
HWY_INLINE VF Tanh(DF d, VF x) {
  const VF e = Exp(d, hn::Mul(hn::Set(d, 2.0f), hn::Abs(x)));
  const VF one = hn::Set(d, 1.0f);
  return hn::CopySign(hn::Sub(one, hn::Div(hn::Set(d, 2.0f), hn::Add(e, one))),
                      x);
}

// kernels::Sigmoid.
HWY_INLINE VF Sigmoid(DF d, VF x) {
  const VF one = hn::Set(d, 1.0f);
  return hn::Div(one, hn::Add(one, Exp(d, hn::Neg(x))));
}

// kernels::QuietNan.
HWY_INLINE VF QuietNan(DF d, VF r) {
  return hn::IfThenElse(hn::IsNaN(r), hn::Set(d, NAN), r);
}

// kernels::GeluOp.
struct VectorGelu {
  HWY_INLINE VF operator()(DF d, VF x) const {
    const VF c = hn::Set(d, kernels::kGeluCubic);
    const VF inner = hn::Mul(hn::Set(d, kernels::kGeluScale),
                             hn::Add(x, hn::Mul(hn::Mul(hn::Mul(c, x), x), x)));
    return QuietNan(d, hn::Mul(hn::Mul(hn::Set(d, 0.5f), x),
                               hn::Add(hn::Set(d, 1.0f), Tanh(d, inner))));
  }
};

// kernels::GeluBackwardOp: (x, dy) -> dx.
struct VectorGeluBackward {
  HWY_INLINE VF operator()(DF d, VF x, VF dy) const {
    const VF half = hn::Set(d, 0.5f);
    const VF one = hn::Set(d, 1.0f);
    const VF scale = hn::Set(d, kernels::kGeluScale);
    const VF x2 = hn::Mul(x, x);
    const VF inner = hn::Mul(
        scale,
        hn::Add(x, hn::Mul(hn::Mul(hn::Set(d, kernels::kGeluCubic), x2), x)));
    const VF t = Tanh(d, inner);
    const VF sech2 = hn::Sub(one, hn::Mul(t, t));
    const VF dinner = hn::Mul(
        scale,
        hn::Add(one, hn::Mul(hn::Set(d, 3.0f * kernels::kGeluCubic), x2)));
    const VF left = hn::Mul(half, hn::Add(one, t));
    const VF right = hn::Mul(hn::Mul(hn::Mul(half, x), sech2), dinner);
    return QuietNan(d, hn::Mul(dy, hn::Add(left, right)));
  }
};

// kernels::SiluOp.
struct VectorSilu {
  HWY_INLINE VF operator()(DF d, VF x) const {
    return QuietNan(d, hn::Mul(x, Sigmoid(d, x)));
  }
};

// kernels::SiluBackwardOp: (x, dy) -> dx.
struct VectorSiluBackward {
  HWY_INLINE VF operator()(DF d, VF x, VF dy) const {
    const VF one = hn::Set(d, 1.0f);
    const VF s = Sigmoid(d, x);
    return QuietNan(
        d, hn::Mul(hn::Mul(dy, s), hn::Add(one, hn::Mul(x, hn::Sub(one, s)))));
  }
};

// One exported kernel per (op, storage type): (a, b, out, n, alpha).
#define FSDPP_SIMD_BINARY(NAME, T, VECTOR, SCALAR)                            \
  void NAME(const void* a, const void* b, void* out, size_t n, float alpha) { \
    (void)alpha;                                                              \
    BinaryLoop<T>(a, b, out, n, VECTOR, SCALAR);                              \
  }
#define FSDPP_SIMD_BINARY_ALL_TYPES(OP, VECTOR, SCALAR) \
  FSDPP_SIMD_BINARY(OP##F32, float, VECTOR, SCALAR)     \
  FSDPP_SIMD_BINARY(OP##Bf16, BFloat16, VECTOR, SCALAR) \
  FSDPP_SIMD_BINARY(OP##F16, Float16, VECTOR, SCALAR)

FSDPP_SIMD_BINARY_ALL_TYPES(Add, VectorAdd{}, kernels::AddOp{})
FSDPP_SIMD_BINARY_ALL_TYPES(Mul, VectorMul{}, kernels::MulOp{})
FSDPP_SIMD_BINARY_ALL_TYPES(Axpy, VectorAxpy{alpha}, kernels::AxpyOp{alpha})
FSDPP_SIMD_BINARY_ALL_TYPES(Scale, VectorScale{alpha}, ScalarScale{alpha})
FSDPP_SIMD_BINARY_ALL_TYPES(GeluBackward, VectorGeluBackward{},
                            kernels::GeluBackwardOp{})
FSDPP_SIMD_BINARY_ALL_TYPES(SiluBackward, VectorSiluBackward{},
                            kernels::SiluBackwardOp{})
#undef FSDPP_SIMD_BINARY_ALL_TYPES
#undef FSDPP_SIMD_BINARY

// One exported kernel per (op, storage type): (x, out, n).
#define FSDPP_SIMD_UNARY_ALL_TYPES(OP, VECTOR, SCALAR) \
  void OP##F32(const void* x, void* out, size_t n) {   \
    UnaryLoop<float>(x, out, n, VECTOR, SCALAR);       \
  }                                                    \
  void OP##Bf16(const void* x, void* out, size_t n) {  \
    UnaryLoop<BFloat16>(x, out, n, VECTOR, SCALAR);    \
  }                                                    \
  void OP##F16(const void* x, void* out, size_t n) {   \
    UnaryLoop<Float16>(x, out, n, VECTOR, SCALAR);     \
  }
FSDPP_SIMD_UNARY_ALL_TYPES(Gelu, VectorGelu{}, kernels::GeluOp{})
FSDPP_SIMD_UNARY_ALL_TYPES(Silu, VectorSilu{}, kernels::SiluOp{})
#undef FSDPP_SIMD_UNARY_ALL_TYPES

void CastF32Bf16(const void* s, void* d, size_t n) {
  CastLoop<float, BFloat16>(s, d, n);
}
void CastF32F16(const void* s, void* d, size_t n) {
  CastLoop<float, Float16>(s, d, n);
}
void CastBf16F32(const void* s, void* d, size_t n) {
  CastLoop<BFloat16, float>(s, d, n);
}
void CastBf16F16(const void* s, void* d, size_t n) {
  CastLoop<BFloat16, Float16>(s, d, n);
}
void CastF16F32(const void* s, void* d, size_t n) {
  CastLoop<Float16, float>(s, d, n);
}
void CastF16Bf16(const void* s, void* d, size_t n) {
  CastLoop<Float16, BFloat16>(s, d, n);
}

const char* Target() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace simd
}  // namespace cpu
}  // namespace fsdpp
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fsdpp {
namespace cpu {
namespace simd {

HWY_EXPORT(AddF32);
HWY_EXPORT(AddBf16);
HWY_EXPORT(AddF16);
HWY_EXPORT(MulF32);
HWY_EXPORT(MulBf16);
HWY_EXPORT(MulF16);
HWY_EXPORT(AxpyF32);
HWY_EXPORT(AxpyBf16);
HWY_EXPORT(AxpyF16);
HWY_EXPORT(ScaleF32);
HWY_EXPORT(ScaleBf16);
HWY_EXPORT(ScaleF16);
HWY_EXPORT(GeluBackwardF32);
HWY_EXPORT(GeluBackwardBf16);
HWY_EXPORT(GeluBackwardF16);
HWY_EXPORT(SiluBackwardF32);
HWY_EXPORT(SiluBackwardBf16);
HWY_EXPORT(SiluBackwardF16);
HWY_EXPORT(GeluF32);
HWY_EXPORT(GeluBf16);
HWY_EXPORT(GeluF16);
HWY_EXPORT(SiluF32);
HWY_EXPORT(SiluBf16);
HWY_EXPORT(SiluF16);
HWY_EXPORT(CastF32Bf16);
HWY_EXPORT(CastF32F16);
HWY_EXPORT(CastBf16F32);
HWY_EXPORT(CastBf16F16);
HWY_EXPORT(CastF16F32);
HWY_EXPORT(CastF16Bf16);
HWY_EXPORT(Target);

namespace {

using BinaryFn = void (*)(const void*, const void*, void*, size_t, float);

// The dispatched kernel of `dtype` among the f32 / bf16 / f16 variants.
BinaryFn Pick(DType dtype, BinaryFn f32, BinaryFn bf16, BinaryFn f16) {
  return dtype == DType::kF32 ? f32 : dtype == DType::kBF16 ? bf16 : f16;
}

using UnaryFn = void (*)(const void*, void*, size_t);

UnaryFn PickUnary(DType dtype, UnaryFn f32, UnaryFn bf16, UnaryFn f16) {
  return dtype == DType::kF32 ? f32 : dtype == DType::kBF16 ? bf16 : f16;
}

}  // namespace

bool IsFloat(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

void Cast(DType from, const void* src, DType to, void* dst, int64_t n) {
  const size_t count = static_cast<size_t>(n);
  if (from == to) {
    if (src != dst) std::memmove(dst, src, count * DTypeSize(from));
    return;
  }
  if (from == DType::kF32 && to == DType::kBF16) {
    HWY_DYNAMIC_DISPATCH(CastF32Bf16)(src, dst, count);
  } else if (from == DType::kF32) {
    HWY_DYNAMIC_DISPATCH(CastF32F16)(src, dst, count);
  } else if (from == DType::kBF16 && to == DType::kF32) {
    HWY_DYNAMIC_DISPATCH(CastBf16F32)(src, dst, count);
  } else if (from == DType::kBF16) {
    HWY_DYNAMIC_DISPATCH(CastBf16F16)(src, dst, count);
  } else if (to == DType::kF32) {
    HWY_DYNAMIC_DISPATCH(CastF16F32)(src, dst, count);
  } else {
    HWY_DYNAMIC_DISPATCH(CastF16Bf16)(src, dst, count);
  }
}

void Add(DType dtype, const void* a, const void* b, void* out, int64_t n) {
  Pick(dtype, HWY_DYNAMIC_DISPATCH(AddF32), HWY_DYNAMIC_DISPATCH(AddBf16),
       HWY_DYNAMIC_DISPATCH(AddF16))(a, b, out, static_cast<size_t>(n), 0.0f);
}

void Mul(DType dtype, const void* a, const void* b, void* out, int64_t n) {
  Pick(dtype, HWY_DYNAMIC_DISPATCH(MulF32), HWY_DYNAMIC_DISPATCH(MulBf16),
       HWY_DYNAMIC_DISPATCH(MulF16))(a, b, out, static_cast<size_t>(n), 0.0f);
}

void Axpy(DType dtype, float alpha, const void* y, const void* x, void* out,
          int64_t n) {
  Pick(dtype, HWY_DYNAMIC_DISPATCH(AxpyF32), HWY_DYNAMIC_DISPATCH(AxpyBf16),
       HWY_DYNAMIC_DISPATCH(AxpyF16))(y, x, out, static_cast<size_t>(n), alpha);
}

void Scale(DType dtype, float alpha, const void* x, void* out, int64_t n) {
  Pick(dtype, HWY_DYNAMIC_DISPATCH(ScaleF32), HWY_DYNAMIC_DISPATCH(ScaleBf16),
       HWY_DYNAMIC_DISPATCH(ScaleF16))(x, x, out, static_cast<size_t>(n),
                                       alpha);
}

void Gelu(DType dtype, const void* x, void* out, int64_t n) {
  PickUnary(dtype, HWY_DYNAMIC_DISPATCH(GeluF32),
            HWY_DYNAMIC_DISPATCH(GeluBf16),
            HWY_DYNAMIC_DISPATCH(GeluF16))(x, out, static_cast<size_t>(n));
}

void Silu(DType dtype, const void* x, void* out, int64_t n) {
  PickUnary(dtype, HWY_DYNAMIC_DISPATCH(SiluF32),
            HWY_DYNAMIC_DISPATCH(SiluBf16),
            HWY_DYNAMIC_DISPATCH(SiluF16))(x, out, static_cast<size_t>(n));
}

void GeluBackward(DType dtype, const void* x, const void* dy, void* dx,
                  int64_t n) {
  Pick(dtype, HWY_DYNAMIC_DISPATCH(GeluBackwardF32),
       HWY_DYNAMIC_DISPATCH(GeluBackwardBf16),
       HWY_DYNAMIC_DISPATCH(GeluBackwardF16))(x, dy, dx, static_cast<size_t>(n),
                                              0.0f);
}

void SiluBackward(DType dtype, const void* x, const void* dy, void* dx,
                  int64_t n) {
  Pick(dtype, HWY_DYNAMIC_DISPATCH(SiluBackwardF32),
       HWY_DYNAMIC_DISPATCH(SiluBackwardBf16),
       HWY_DYNAMIC_DISPATCH(SiluBackwardF16))(x, dy, dx, static_cast<size_t>(n),
                                              0.0f);
}

const char* TargetName() { return HWY_DYNAMIC_DISPATCH(Target)(); }

}  // namespace simd
}  // namespace cpu
}  // namespace fsdpp
#endif  // HWY_ONCE
