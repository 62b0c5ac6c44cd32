// Vectorised host kernels for the memory-bound elementwise ops: casts
// between f32, bf16 and f16, add / mul / axpy / scale and the GELU / SiLU
// activations forward and backward in each of them. Google Highway compiles
// each kernel for AVX2, AVX-512 and an emulated 128-bit target
// (third_party/hwy.BUILD) and dispatches at run time to the best one the CPU
// has, so one binary runs on any x86-64.
//
// Bit-exact with the scalar reference (tensor/kernels/, core/dtype.h): each
// element is widened to f32, computed with the same IEEE operations in the
// same order (no fused multiply-add: this file is compiled with
// -ffp-contract=off), and rounded back to nearest-even with NaN kept quiet;
// f16 conversions use the F16C instructions (same rounding) where the target
// has them and the scalar reference otherwise. The tails shorter than a
// vector run the scalar reference itself. So swapping these kernels in moves
// no result by a bit, and tests compare them bitwise on every target.
//
// Single-threaded: callers split large arrays across threads.
#ifndef FSDPP_TENSOR_CPU_SIMD_H_
#define FSDPP_TENSOR_CPU_SIMD_H_

#include <cstdint>

#include "core/dtype.h"

namespace fsdpp {
namespace cpu {
namespace simd {

// True for the dtypes these kernels take (f32, bf16, f16).
bool IsFloat(DType dtype);

// dst[i] = src[i] converted from `from` to `to` (both float dtypes, may be
// equal; no aliasing unless equal).
void Cast(DType from, const void* src, DType to, void* dst, int64_t n);

// out[i] = a[i] + b[i]; out may alias a or b.
void Add(DType dtype, const void* a, const void* b, void* out, int64_t n);
// out[i] = a[i] * b[i]; out may alias a or b.
void Mul(DType dtype, const void* a, const void* b, void* out, int64_t n);
// out[i] = y[i] + alpha * x[i] (kernels::AxpyOp); out may alias y or x.
void Axpy(DType dtype, float alpha, const void* y, const void* x, void* out,
          int64_t n);
// out[i] = alpha * x[i]; out may alias x.
void Scale(DType dtype, float alpha, const void* x, void* out, int64_t n);

// The activations, bit-exact with the scalar functors: in f32 through
// kernels::ExpApprox / TanhApprox (plain float operations); in bf16 and f16
// looked up in tables of the functors' values (forward) or derivatives
// (backward) at all 2^16 inputs, built on first use (256 KiB each):
// out[i] = GELU-tanh(x[i]) or SiLU(x[i]); out may alias x.
void Gelu(DType dtype, const void* x, void* out, int64_t n);
void Silu(DType dtype, const void* x, void* out, int64_t n);
// dx[i] = dy[i] * GELU'(x[i]) or dy[i] * SiLU'(x[i]); dx may alias x or dy.
void GeluBackward(DType dtype, const void* x, const void* dy, void* dx,
                  int64_t n);
void SiluBackward(DType dtype, const void* x, const void* dy, void* dx,
                  int64_t n);

// The name of the target the kernels dispatch to on this CPU ("AVX3_DL").
const char* TargetName();

}  // namespace simd
}  // namespace cpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CPU_SIMD_H_
