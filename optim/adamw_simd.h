// AdamW's per-element update (optim/kernels/adamw.h) vectorised with Google
// Highway, dispatched at run time to the best target of the CPU. Bit-exact
// with kernels::AdamWElement: the same IEEE operations (multiply, add,
// divide, square root; no fused multiply-add — the file is compiled with
// -ffp-contract=off) in the same order, and the optional compute-dtype copy
// of the parameter rounded to nearest even like FromFloat. So the CPU still
// agrees with the CUDA kernel bit for bit.
#ifndef FSDPP_OPTIM_ADAMW_SIMD_H_
#define FSDPP_OPTIM_ADAMW_SIMD_H_

#include <cstdint>

#include "core/dtype.h"
#include "optim/kernels/adamw.h"

namespace fsdpp {
namespace adamw_simd {

// For i in [0, n): AdamWElement(s, grad[i], &param[i], &exp_avg[i],
// &exp_avg_sq[i]), then copy[i] = param[i] as `copy_dtype` (f32, bf16 or
// f16) when copy is not null. Single-threaded.
void Step(const kernels::AdamWScalars& s, const float* grad, float* param,
          float* exp_avg, float* exp_avg_sq, DType copy_dtype, void* copy,
          int64_t n);

}  // namespace adamw_simd
}  // namespace fsdpp

#endif  // FSDPP_OPTIM_ADAMW_SIMD_H_
