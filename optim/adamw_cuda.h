// The optimizer's CUDA kernels (--config=cuda only): the fused AdamW step and
// the loss scaler's fused unscale-and-check, both over the per-element math of
// optim/kernels/adamw.h that the CPU loops run too.
//
// Plain C++ (no CUDA types or syntax) so host-compiled optim/*.cc can include
// it. Kernels run on the legacy default stream, like tensor/cuda's, so they
// are ordered after the ops that produced the gradients; the namespace is
// `gpu` for the reason given in tensor/cuda/cuda_backend.h.
#ifndef FSDPP_OPTIM_ADAMW_CUDA_H_
#define FSDPP_OPTIM_ADAMW_CUDA_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "optim/kernels/adamw.h"

namespace fsdpp {
namespace gpu {

// A step's scale read on the device (AdamW::StepGuard): device pointers to
// the step's loss and squared gradient norm (f32), and the clip norm.
struct DeviceGradScale {
  const float* loss = nullptr;
  const float* norm_sq = nullptr;
  double max_norm = 0;
};

// Enqueues one fused AdamW pass over `n` f32 elements on GPU `device`:
// param, exp_avg and exp_avg_sq are updated in place from grad. When `copy`
// is not null it receives the updated param rounded to `copy_dtype` (f32,
// bf16 or f16) in the same pass. With `guard` (its pointers set) the
// gradient scale is kernels::GuardedGradScale of its values, and nothing is
// written when they are not finite; else scalars.grad_scale. Returns the
// launch error, naming the kernel.
absl::Status AdamWStepCuda(int device, const kernels::AdamWScalars& scalars,
                           const float* grad, float* param, float* exp_avg,
                           float* exp_avg_sq, void* copy, DType copy_dtype,
                           int64_t n, const DeviceGradScale& guard = {});

// Enqueues grad[i] *= inv_scale over `n` f32 elements on GPU `device`, and
// sets the device int `*found_flag` to 1 when any element was inf or NaN (it
// is never reset here: zero it once, run this over every tensor, read it once).
absl::Status UnscaleCuda(int device, float* grad, int64_t n, float inv_scale,
                         int32_t* found_flag);

}  // namespace gpu
}  // namespace fsdpp

#endif  // FSDPP_OPTIM_ADAMW_CUDA_H_
