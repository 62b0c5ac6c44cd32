// Fused causal attention kernels for the CPU backend (flash-attention style,
// Highway SIMD with runtime dispatch); the math and the layouts are those of
// tensor/kernels/attention.h, whose scalar functions are the reference the
// tests hold these kernels to. Work memory is O(T hd) per thread: no [T, T]
// matrix is ever formed.
#ifndef FSDPP_TENSOR_CPU_ATTENTION_H_
#define FSDPP_TENSOR_CPU_ATTENTION_H_

#include <cstdint>

#include "core/dtype.h"

namespace fsdpp {
namespace cpu {

// q [b, h, t, hd], k and v [b, kv, t, hd], out [b, h, t, hd], all of the
// float dtype `dtype`; lse [b, h, t]. Runs on the OpenMP pool.
void CausalAttentionForward(DType dtype, const void* q, const void* k,
                            const void* v, int64_t b, int64_t h, int64_t kv,
                            int64_t t, int64_t hd, float scale, void* out,
                            float* lse);

// dq, dk, dv (overwritten) from dout, recomputing the probabilities from lse.
void CausalAttentionBackward(DType dtype, const void* q, const void* k,
                             const void* v, const void* out, const float* lse,
                             const void* dout, int64_t b, int64_t h, int64_t kv,
                             int64_t t, int64_t hd, float scale, void* dq,
                             void* dk, void* dv);

}  // namespace cpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CPU_ATTENTION_H_
