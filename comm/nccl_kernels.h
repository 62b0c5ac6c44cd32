// Device casts for the NCCL backend: bf16 / f16 buffers are reduced with f32
// accumulation by casting into an f32 scratch, reducing that with NCCL and
// casting back.
//
// Plain C++ (no CUDA syntax) so host-compiled code can include it; the casts
// use the round-to-nearest-even conversions of core/dtype.h, so GPU results
// round exactly like the CPU (Gloo) backend's.
#ifndef FSDPP_COMM_NCCL_KERNELS_H_
#define FSDPP_COMM_NCCL_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"

namespace fsdpp {

// Enqueues on `stream` the conversion of `n` elements of `dtype` (f32, bf16
// or f16) at `in` to f32 at `out` (on the current device). Returns the launch
// error, if any; InvalidArgument for other dtypes.
absl::Status CastToF32Async(const void* in, DType dtype, float* out, int64_t n,
                            cudaStream_t stream);

// Enqueues on `stream` the rounding of `n` f32 elements at `in` to `dtype`
// (f32, bf16 or f16) at `out`.
absl::Status CastFromF32Async(const float* in, DType dtype, void* out,
                              int64_t n, cudaStream_t stream);

}  // namespace fsdpp

#endif  // FSDPP_COMM_NCCL_KERNELS_H_
