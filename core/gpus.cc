// The GPUs this process sees; see gpus.h.
#include "core/gpus.h"

#include "absl/strings/str_cat.h"

#if defined(FSDPP_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "core/cuda_runtime.h"
#endif

namespace fsdpp {

bool BuiltWithCuda() {
#if defined(FSDPP_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

int GpuCount() {
#if defined(FSDPP_WITH_CUDA)
  return CudaDeviceCount();
#else
  return 0;
#endif
}

absl::StatusOr<std::string> GpuName(int device) {
  if (!BuiltWithCuda()) {
    return absl::FailedPreconditionError(
        "this binary was built without CUDA (build with --config=cuda)");
  }
  if (device < 0 || device >= GpuCount()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU ", device, " is not one of the ", GpuCount(), " visible GPU(s)"));
  }
#if defined(FSDPP_WITH_CUDA)
  cudaDeviceProp properties;
  FSDPP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, device));
  return std::string(properties.name);
#else
  return std::string();
#endif
}

absl::Status UseGpu(int device) {
  if (!BuiltWithCuda()) {
    return absl::FailedPreconditionError(
        "this binary was built without CUDA: build and run it with "
        "--config=cuda (bazel run --config=cuda //trainer:train ...)");
  }
  const int count = GpuCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda:", device, " is not there: this machine shows ", count, " GPU(s)",
        count == 0 ? " (no driver or device)" : "",
        "; run at most one rank per GPU (--nproc_per_node)"));
  }
#if defined(FSDPP_WITH_CUDA)
  FSDPP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  RegisterCudaAllocators();
#endif
  return absl::OkStatus();
}

}  // namespace fsdpp
