// Highway kernels behind simd.h, compiled once per target by
// hwy/foreach_target.h (this file includes itself through it) and chosen at
// run time by HWY_DYNAMIC_DISPATCH. Build with -ffp-contract=off (BUILD):
// a fused multiply-add would round differently from the scalar reference.
#include "tensor/cpu/simd.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

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
    const VF e = Exp(d, hn::Mul(hn::Set(d, -2.0f), inner));
    return QuietNan(d, hn::Div(x, hn::Add(hn::Set(d, 1.0f), e)));
  }
};

// kernels::GeluGrad.
HWY_INLINE VF GeluGrad(DF d, VF x) {
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
      scale, hn::Add(one, hn::Mul(hn::Set(d, 3.0f * kernels::kGeluCubic), x2)));
  const VF left = hn::Mul(half, hn::Add(one, t));
  const VF right = hn::Mul(hn::Mul(hn::Mul(half, x), sech2), dinner);
  return hn::Add(left, right);
}

// kernels::GeluBackwardOp: (x, dy) -> dx.
struct VectorGeluBackward {
  HWY_INLINE VF operator()(DF d, VF x, VF dy) const {
    return QuietNan(d, hn::Mul(dy, GeluGrad(d, x)));
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
    const VF grad = hn::Mul(s, hn::Add(one, hn::Mul(x, hn::Sub(one, s))));
    return QuietNan(d, hn::Mul(dy, grad));
  }
};

// The activations of the 16-bit types by table: `table` holds the f32 value
// (forward) or derivative (backward) of the scalar functor at each of the
// 2^16 bit patterns, so a lookup gives the reference's result bit for bit
// and the kernel does no transcendental arithmetic at all. Tables and their
// use: tensor/cpu/simd.cc below HWY_ONCE.

// table[x[0]], ..., table[x[lanes - 1]]. Scalar loads into a buffer: on
// this project's AMD Zen 4 machine 15-25% faster than Highway's GatherIndex
// (vpgatherdd) in the kernels below, and the same on every target.
HWY_INLINE VF Gathered(DF d, const float* table, const uint16_t* x) {
  HWY_ALIGN float got[hn::MaxLanes(d)];
  for (size_t j = 0; j < hn::MaxLanes(d); ++j) got[j] = table[x[j]];
  return hn::Load(d, got);
}

// out[i] = table[x[i]] rounded to T; out may alias x.
template <typename T>
HWY_INLINE void LookupLoop(const void* x_raw, void* out_raw, size_t n,
                           const float* table) {
  const uint16_t* x = static_cast<const uint16_t*>(x_raw);
  T* out = static_cast<T*>(out_raw);
  const DF d;
  const size_t lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    StoreF(d, Gathered(d, table, x + i), out + i);
  }
  for (; i < n; ++i) out[i] = FromFloat<T>(table[x[i]]);
}

// dx[i] = dy[i] * table[x[i]] (the QuietNan'd product of the backward
// functors) rounded to T; dx may alias x or dy.
template <typename T>
HWY_INLINE void ScaledLookupLoop(const void* x_raw, const void* dy_raw,
                                 void* dx_raw, size_t n, const float* table) {
  const uint16_t* x = static_cast<const uint16_t*>(x_raw);
  const T* dy = static_cast<const T*>(dy_raw);
  T* dx = static_cast<T*>(dx_raw);
  const DF d;
  const size_t lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const VF grad = Gathered(d, table, x + i);
    StoreF(d, QuietNan(d, hn::Mul(LoadF(d, dy + i), grad)), dx + i);
  }
  for (; i < n; ++i) {
    dx[i] = FromFloat<T>(kernels::QuietNan(ToFloat(dy[i]) * table[x[i]]));
  }
}

void LookupBf16(const void* x, void* out, size_t n, const float* table) {
  LookupLoop<BFloat16>(x, out, n, table);
}
void LookupF16(const void* x, void* out, size_t n, const float* table) {
  LookupLoop<Float16>(x, out, n, table);
}
void ScaledLookupBf16(const void* x, const void* dy, void* dx, size_t n,
                      const float* table) {
  ScaledLookupLoop<BFloat16>(x, dy, dx, n, table);
}
void ScaledLookupF16(const void* x, const void* dy, void* dx, size_t n,
                     const float* table) {
  ScaledLookupLoop<Float16>(x, dy, dx, n, table);
}

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
FSDPP_SIMD_BINARY(GeluBackwardF32, float, VectorGeluBackward{},
                  kernels::GeluBackwardOp{})
FSDPP_SIMD_BINARY(SiluBackwardF32, float, VectorSiluBackward{},
                  kernels::SiluBackwardOp{})
#undef FSDPP_SIMD_BINARY_ALL_TYPES
#undef FSDPP_SIMD_BINARY

// The f32 activations: (x, out, n).
void GeluF32(const void* x, void* out, size_t n) {
  UnaryLoop<float>(x, out, n, VectorGelu{}, kernels::GeluOp{});
}
void SiluF32(const void* x, void* out, size_t n) {
  UnaryLoop<float>(x, out, n, VectorSilu{}, kernels::SiluOp{});
}

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
HWY_EXPORT(SiluBackwardF32);
HWY_EXPORT(GeluF32);
HWY_EXPORT(SiluF32);
HWY_EXPORT(LookupBf16);
HWY_EXPORT(LookupF16);
HWY_EXPORT(ScaledLookupBf16);
HWY_EXPORT(ScaledLookupF16);
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

// `f` at each of the 2^16 bit patterns of T, in f32.
template <typename T, class F>
std::vector<float> TableOf(F f) {
  std::vector<float> table(size_t{1} << 16);
  for (uint32_t bits = 0; bits < table.size(); ++bits) {
    table[bits] = f(ToFloat(T::FromBits(static_cast<uint16_t>(bits))));
  }
  return table;
}

enum class Activation { kGelu, kSilu, kGeluGrad, kSiluGrad };

// The table of `activation` over the 16-bit type T, built on first use (256
// KiB each; thread-safe through the function-local statics).
template <typename T>
const float* Table(Activation activation) {
  switch (activation) {
    case Activation::kGelu: {
      static const std::vector<float> table = TableOf<T>(kernels::GeluOp{});
      return table.data();
    }
    case Activation::kSilu: {
      static const std::vector<float> table = TableOf<T>(kernels::SiluOp{});
      return table.data();
    }
    case Activation::kGeluGrad: {
      static const std::vector<float> table = TableOf<T>(kernels::GeluGrad);
      return table.data();
    }
    case Activation::kSiluGrad: {
      static const std::vector<float> table = TableOf<T>(kernels::SiluGrad);
      return table.data();
    }
  }
  return nullptr;
}

// out = activation(x) for f32 (`f32`, computed) or a 16-bit type (looked up).
void Activate(DType dtype, Activation activation, UnaryFn f32, const void* x,
              void* out, int64_t n) {
  const size_t count = static_cast<size_t>(n);
  if (dtype == DType::kF32) {
    f32(x, out, count);
  } else if (dtype == DType::kBF16) {
    HWY_DYNAMIC_DISPATCH(LookupBf16)
    (x, out, count, Table<BFloat16>(activation));
  } else {
    HWY_DYNAMIC_DISPATCH(LookupF16)(x, out, count, Table<Float16>(activation));
  }
}

// dx = dy * activation'(x), as Activate.
void ActivateBackward(DType dtype, Activation grad, BinaryFn f32, const void* x,
                      const void* dy, void* dx, int64_t n) {
  const size_t count = static_cast<size_t>(n);
  if (dtype == DType::kF32) {
    f32(x, dy, dx, count, 0.0f);
  } else if (dtype == DType::kBF16) {
    HWY_DYNAMIC_DISPATCH(ScaledLookupBf16)
    (x, dy, dx, count, Table<BFloat16>(grad));
  } else {
    HWY_DYNAMIC_DISPATCH(ScaledLookupF16)
    (x, dy, dx, count, Table<Float16>(grad));
  }
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
  Activate(dtype, Activation::kGelu, HWY_DYNAMIC_DISPATCH(GeluF32), x, out, n);
}

void Silu(DType dtype, const void* x, void* out, int64_t n) {
  Activate(dtype, Activation::kSilu, HWY_DYNAMIC_DISPATCH(SiluF32), x, out, n);
}

void GeluBackward(DType dtype, const void* x, const void* dy, void* dx,
                  int64_t n) {
  ActivateBackward(dtype, Activation::kGeluGrad,
                   HWY_DYNAMIC_DISPATCH(GeluBackwardF32), x, dy, dx, n);
}

void SiluBackward(DType dtype, const void* x, const void* dy, void* dx,
                  int64_t n) {
  ActivateBackward(dtype, Activation::kSiluGrad,
                   HWY_DYNAMIC_DISPATCH(SiluBackwardF32), x, dy, dx, n);
}

const char* TargetName() { return HWY_DYNAMIC_DISPATCH(Target)(); }

}  // namespace simd
}  // namespace cpu
}  // namespace fsdpp
#endif  // HWY_ONCE
