// CUDA kernels of optim; see adamw_cuda.h.
//
// Grid-stride loops over the shared element functions of
// optim/kernels/adamw.h, one thread per element and no reductions, so each
// output is the same f32 expression the CPU loop computes. This file is built
// with --fmad=false (see BUILD): nvcc would otherwise fuse a * b + c into an
// FMA and the GPU update would differ from the CPU one in the last bit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "core/cuda_runtime.h"
#include "core/status.h"
#include "optim/adamw_cuda.h"

namespace fsdpp {
namespace gpu {
namespace {

constexpr int kThreads = 256;
// Grid cap: grid-stride loops cover larger tensors.
constexpr int64_t kMaxBlocks = 4096;

__device__ __forceinline__ int64_t FirstIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(blockDim.x) * gridDim.x;
}

// `copy` may be null (no compute copy); C is its storage type.
// The step's scalars with the guard's scale; false: the step is skipped.
__device__ __forceinline__ bool Guarded(const DeviceGradScale& guard,
                                        kernels::AdamWScalars* s) {
  if (guard.loss == nullptr) return true;
  return kernels::GuardedGradScale(*guard.loss, *guard.norm_sq, guard.max_norm,
                                   &s->grad_scale);
}

template <typename C>
__global__ void AdamWKernel(kernels::AdamWScalars s, DeviceGradScale guard,
                            const float* __restrict__ grad,
                            float* __restrict__ param,
                            float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq,
                            C* __restrict__ copy, int64_t n) {
  if (!Guarded(guard, &s)) return;
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    kernels::AdamWElement(s, grad[i], &p, &m, &v);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (copy != nullptr) copy[i] = FromFloat<C>(p);
  }
}

// The same over four elements per thread-iteration with 16-byte loads and
// stores of the f32 tensors (all aligned; n4 = n / 4 quads), the update of
// each element unchanged.
template <typename C>
__global__ void AdamWQuadKernel(kernels::AdamWScalars s, DeviceGradScale guard,
                                const float4* __restrict__ grad,
                                float4* __restrict__ param,
                                float4* __restrict__ exp_avg,
                                float4* __restrict__ exp_avg_sq,
                                C* __restrict__ copy, int64_t n4) {
  if (!Guarded(guard, &s)) return;
  for (int64_t i = FirstIndex(); i < n4; i += GridStride()) {
    const float4 g = grad[i];
    float4 p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    kernels::AdamWElement(s, g.x, &p.x, &m.x, &v.x);
    kernels::AdamWElement(s, g.y, &p.y, &m.y, &v.y);
    kernels::AdamWElement(s, g.z, &p.z, &m.z, &v.z);
    kernels::AdamWElement(s, g.w, &p.w, &m.w, &v.w);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (copy != nullptr) {
      C* c = copy + 4 * i;
      c[0] = FromFloat<C>(p.x);
      c[1] = FromFloat<C>(p.y);
      c[2] = FromFloat<C>(p.z);
      c[3] = FromFloat<C>(p.w);
    }
  }
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

__global__ void UnscaleKernel(float* __restrict__ grad, int64_t n,
                              float inv_scale, int32_t* found_flag) {
  bool found = false;
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    grad[i] = kernels::UnscaleElement(grad[i], inv_scale, &found);
  }
  if (found) atomicOr(found_flag, 1);
}

int Blocks(int64_t n) {
  return static_cast<int>(
      std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads));
}

// The launch status of the kernel just enqueued, naming `what`.
absl::Status LaunchStatus(const char* what) {
  cudaError_t error = cudaGetLastError();
  // A launch never fails with "not ready": that is a stale result of an
  // earlier cudaEventQuery on this thread, not an error.
  if (error == cudaErrorNotReady) error = cudaSuccess;
  return CudaStatus(error, what);
}

template <typename C>
absl::Status LaunchAdamW(const kernels::AdamWScalars& s,
                         const DeviceGradScale& guard, const float* grad,
                         float* param, float* exp_avg, float* exp_avg_sq,
                         void* copy, int64_t n) {
  C* c = static_cast<C*>(copy);
  int64_t done = 0;
  if (Aligned16(grad) && Aligned16(param) && Aligned16(exp_avg) &&
      Aligned16(exp_avg_sq) && n >= 4) {
    const int64_t n4 = n / 4;
    AdamWQuadKernel<C><<<Blocks(n4), kThreads, 0, cudaStreamLegacy>>>(
        s, guard, reinterpret_cast<const float4*>(grad),
        reinterpret_cast<float4*>(param), reinterpret_cast<float4*>(exp_avg),
        reinterpret_cast<float4*>(exp_avg_sq), c, n4);
    FSDPP_RETURN_IF_ERROR(LaunchStatus("AdamW kernel launch"));
    done = 4 * n4;
  }
  if (done == n) return absl::OkStatus();
  AdamWKernel<C><<<Blocks(n - done), kThreads, 0, cudaStreamLegacy>>>(
      s, guard, grad + done, param + done, exp_avg + done, exp_avg_sq + done,
      c == nullptr ? nullptr : c + done, n - done);
  return LaunchStatus("AdamW kernel launch");
}

}  // namespace

absl::Status AdamWStepCuda(int device, const kernels::AdamWScalars& scalars,
                           const float* grad, float* param, float* exp_avg,
                           float* exp_avg_sq, void* copy, DType copy_dtype,
                           int64_t n, const DeviceGradScale& guard) {
  if (n <= 0) return absl::OkStatus();
  if ((guard.loss == nullptr) != (guard.norm_sq == nullptr)) {
    return absl::InvalidArgumentError(
        "AdamWStepCuda: the guard needs both the loss and the norm");
  }
  FSDPP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  if (copy == nullptr) {
    return LaunchAdamW<float>(scalars, guard, grad, param, exp_avg, exp_avg_sq,
                              nullptr, n);
  }
  switch (copy_dtype) {
    case DType::kF32:
      return LaunchAdamW<float>(scalars, guard, grad, param, exp_avg,
                                exp_avg_sq, copy, n);
    case DType::kBF16:
      return LaunchAdamW<BFloat16>(scalars, guard, grad, param, exp_avg,
                                   exp_avg_sq, copy, n);
    case DType::kF16:
      return LaunchAdamW<Float16>(scalars, guard, grad, param, exp_avg,
                                  exp_avg_sq, copy, n);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("AdamWStepCuda: compute copy dtype ",
                       DTypeName(copy_dtype), " is not a float"));
  }
}

absl::Status UnscaleCuda(int device, float* grad, int64_t n, float inv_scale,
                         int32_t* found_flag) {
  if (n <= 0) return absl::OkStatus();
  FSDPP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  UnscaleKernel<<<Blocks(n), kThreads, 0, cudaStreamLegacy>>>(
      grad, n, inv_scale, found_flag);
  return LaunchStatus("Unscale kernel launch");
}

}  // namespace gpu
}  // namespace fsdpp
