// CausalAttention / CausalAttentionBackward on cuDNN's fused SDPA engines,
// for the CUDA backend (--config=cuda only).
//
// One CudnnAttention per device holds a cuDNN handle, the plan cache
// (tensor/cuda/cudnn_sdpa.h: a plan per shape, built on first use) and a
// workspace that grows to the largest plan's need. Everything runs on the
// legacy default stream, like the rest of the CUDA backend, so no event or
// synchronisation is needed between our kernels and cuDNN's.
//
// Which calls it takes (Applies): bf16 / f16, head dim a multiple of 8 and at
// most kSdpaMaxHeadDim, and for the backward T > 1 (cuDNN refuses T = 1).
// The rest, and every call when FSDPP_CUDNN_ATTENTION=0 is set, stay on the
// backend's own kernel (the f32 path and the tests' reference). The backward
// is cuDNN's deterministic form: reruns are bit-identical.
//
// When cuDNN cannot run here (no handle, an unsupported version, or no
// engine finalizes a plan), the refusal is printed once to stderr with
// cuDNN's reason and that direction (forward or backward; both when there is
// no handle) goes to the backend's own kernel from then on. A plan that was
// built and then fails to execute is an error.
#ifndef FSDPP_TENSOR_CUDA_CUDNN_ATTENTION_H_
#define FSDPP_TENSOR_CUDA_CUDNN_ATTENTION_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace fsdpp {
namespace gpu {

// The problem of one call: q [b, h, t, hd], k and v [b, kv, t, hd], out like
// q, lse [b, h, t] f32, all contiguous device buffers.
struct AttentionCall {
  DType dtype = DType::kBF16;
  int64_t b = 0, h = 0, kv = 0, t = 0, hd = 0;
  float scale = 0.0f;
};

class CudnnAttention {
 public:
  // The instance for `device` (created on first use; never destroyed).
  static CudnnAttention* ForDevice(int device);

  // Whether cuDNN takes this forward (backward: also T > 1).
  static bool Applies(const AttentionCall& call, bool backward);

  // Runs the forward. false: cuDNN could not build a plan for it (said once
  // on stderr), so the caller runs its own kernel; an error: it failed.
  absl::StatusOr<bool> Forward(const AttentionCall& call, const void* q,
                               const void* k, const void* v, void* out,
                               float* lse);
  // Likewise the backward: dq, dk, dv from q, k, v, out, lse and dout.
  absl::StatusOr<bool> Backward(const AttentionCall& call, const void* q,
                                const void* k, const void* v, const void* out,
                                const float* lse, const void* dout, void* dq,
                                void* dk, void* dv);

  // Forward and backward calls cuDNN ran so far (for tests and logs).
  int64_t calls() const;

 private:
  class Impl;
  explicit CudnnAttention(int device);
  Impl* impl_;
};

}  // namespace gpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CUDA_CUDNN_ATTENTION_H_
