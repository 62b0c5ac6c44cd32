// f32 <-> bf16 / f16 cast kernels of the NCCL backend; see nccl_kernels.h.
//
// One grid-stride kernel per direction and storage type, over the shared
// host/device conversions of core/dtype.h. The grid is capped so huge buffers
// do not launch millions of blocks.
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "comm/nccl_kernels.h"
#include "core/cuda_runtime.h"

namespace fsdpp {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

template <typename From, typename To>
__global__ void CastKernel(const From* __restrict__ in, To* __restrict__ out,
                           int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    out[i] = FromFloat<To>(ToFloat(in[i]));
  }
}

template <typename From, typename To>
absl::Status Launch(const void* in, void* out, int64_t n, cudaStream_t stream,
                    const char* what) {
  if (n <= 0) return absl::OkStatus();
  const int64_t blocks =
      std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads);
  CastKernel<From, To><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const From*>(in), static_cast<To*>(out), n);
  cudaError_t error = cudaGetLastError();
  // A launch never fails with "not ready": that is a stale result of an
  // earlier cudaEventQuery on this thread, not an error.
  if (error == cudaErrorNotReady) error = cudaSuccess;
  return CudaStatus(error, what);
}

}  // namespace

absl::Status CastToF32Async(const void* in, DType dtype, float* out, int64_t n,
                            cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return Launch<float, float>(in, out, n, stream, "CastToF32 (f32)");
    case DType::kBF16:
      return Launch<BFloat16, float>(in, out, n, stream, "CastToF32 (bf16)");
    case DType::kF16:
      return Launch<Float16, float>(in, out, n, stream, "CastToF32 (f16)");
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("CastToF32: ", DTypeName(dtype), " is not a float"));
  }
}

absl::Status CastFromF32Async(const float* in, DType dtype, void* out,
                              int64_t n, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return Launch<float, float>(in, out, n, stream, "CastFromF32 (f32)");
    case DType::kBF16:
      return Launch<float, BFloat16>(in, out, n, stream, "CastFromF32 (bf16)");
    case DType::kF16:
      return Launch<float, Float16>(in, out, n, stream, "CastFromF32 (f16)");
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("CastFromF32: ", DTypeName(dtype), " is not a float"));
  }
}

}  // namespace fsdpp
