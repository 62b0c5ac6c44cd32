// Fused causal attention kernels for the CPU backend (flash-attention style,
// Highway SIMD with runtime dispatch); the math and the layouts are those of
// tensor/kernels/attention.h, whose scalar functions are the reference the
// tests hold these kernels to. Work memory is O(T hd) per thread: no [T, T]
// matrix is ever formed.
#ifndef FSDPP_TENSOR_CPU_ATTENTION_H_
#define FSDPP_TENSOR_CPU_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace fsdpp {
namespace cpu {

// q [b, h, t, hd], k and v [b, kv, t, hd], out [b, h, t, hd], all of the
// float dtype `dtype`; lse [b, h, t]. Runs on the OpenMP pool. key_lo,
// key_hi: the rows' key ranges (tensor/ops.h KeyRange), each null or
// [b, t]; key tiles outside a query tile's rows' ranges are skipped.
void CausalAttentionForward(DType dtype, const void* q, const void* k,
                            const void* v, int64_t b, int64_t h, int64_t kv,
                            int64_t t, int64_t hd, float scale, void* out,
                            float* lse, const int32_t* key_lo = nullptr,
                            const int32_t* key_hi = nullptr);

// dq, dk, dv (overwritten) from dout, recomputing the probabilities from lse.
void CausalAttentionBackward(DType dtype, const void* q, const void* k,
                             const void* v, const void* out, const float* lse,
                             const void* dout, int64_t b, int64_t h, int64_t kv,
                             int64_t t, int64_t hd, float scale, void* dq,
                             void* dk, void* dv,
                             const int32_t* key_lo = nullptr,
                             const int32_t* key_hi = nullptr);

// bf16 and f32 (`dtype`), the same contract through oneDNN's matmuls on
// blocks of kBlockedAttentionRows query rows (attention_blocked.cc): the CPU
// backend's path for those dtypes, faster than the kernels above (GPT-2's
// heads, fwd + bwd: f32 1.5x at T = 256 and 1.8x at T = 1024; bf16 most on
// CPUs with bf16 dot products; docs/PERFORMANCE.md). bf16 where bf16
// matmuls are widened (OneDnnBf16MatmulMode): a group's tensors are widened
// to f32 once and its block matmuls run on the f32 kernels, P and dS
// rounded to bf16 values as the native path rounds them (GPT-2's heads on
// an Intel CPU without AMX, fwd + bwd: 0.76-0.90x the native path's time
// at T = 256). Work memory O(b h kBlockedAttentionRows T) plus, for bf16,
// f32 accumulators of dk and dv (widened: f32 copies of the group's
// tensors): linear in T, no [T, T] matrix. InvalidArgument for another
// dtype (or a bad FSDPP_CPU_BF16_MATMUL for bf16); other errors only from
// oneDNN.
// The kv heads (with their query heads) are taken in groups whose work
// buffers fit `work_bytes` (at least one kv head a group); the buffers are
// kept per thread for its next call.
inline constexpr int64_t kBlockedAttentionRows = 128;
inline constexpr int64_t kBlockedAttentionWorkBytes = int64_t{64} << 20;
// Whether a bf16 call of these dims takes the widened path: where bf16
// matmuls are widened and one kv head's widened work (its score buffers
// and f32 copies of its tensors) fits kBlockedAttentionWorkBytes; a longer
// sequence runs native, whose work per kv head is the smaller.
// InvalidArgument for dims that are not all positive with h a multiple of
// kv, or a bad FSDPP_CPU_BF16_MATMUL.
absl::StatusOr<bool> BlockedAttentionWidensBf16(int64_t h, int64_t kv,
                                                int64_t t, int64_t hd);
// key_lo, key_hi as above (masked scores; a block's matmuls run over the
// keys from its rows' smallest lo to their largest hi, over all heads).
absl::Status BlockedAttentionForward(
    DType dtype, const void* q, const void* k, const void* v, int64_t b,
    int64_t h, int64_t kv, int64_t t, int64_t hd, float scale, void* out,
    float* lse, const int32_t* key_lo = nullptr,
    const int32_t* key_hi = nullptr,
    int64_t work_bytes = kBlockedAttentionWorkBytes);
absl::Status BlockedAttentionBackward(
    DType dtype, const void* q, const void* k, const void* v, const void* out,
    const float* lse, const void* dout, int64_t b, int64_t h, int64_t kv,
    int64_t t, int64_t hd, float scale, void* dq, void* dk, void* dv,
    const int32_t* key_lo = nullptr, const int32_t* key_hi = nullptr,
    int64_t work_bytes = kBlockedAttentionWorkBytes);

}  // namespace cpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CPU_ATTENTION_H_
