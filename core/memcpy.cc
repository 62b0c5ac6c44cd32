// Host/device byte movement; see memcpy.h.
#include "core/memcpy.h"

#include <cstring>

#include "absl/strings/str_cat.h"

#if defined(FSDPP_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace fsdpp {
namespace {

absl::Status Unsupported(const char* op, Device a, Device b) {
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": cannot move bytes between ", a.ToString(), " and ", b.ToString(),
#if defined(FSDPP_WITH_CUDA)
      ""
#else
      " (this build has no CUDA support)"
#endif
      ));
}

}  // namespace

absl::Status CopyBytes(void* dst, Device dst_device, const void* src,
                       Device src_device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  // Between meta buffers there is nothing to move (a dry run, plan/).
  if (dst_device.is_meta() && src_device.is_meta()) return absl::OkStatus();
  if (dst_device.is_meta() || src_device.is_meta()) {
    return Unsupported("CopyBytes", src_device, dst_device);
  }
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    if (dst != src) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
#if defined(FSDPP_WITH_CUDA)
  cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaMemcpy ", src_device.ToString(), " -> ",
                     dst_device.ToString(), ": ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
#else
  return Unsupported("CopyBytes", src_device, dst_device);
#endif
}

absl::Status ZeroBytes(void* dst, Device device, size_t bytes) {
  if (bytes == 0 || device.is_meta()) return absl::OkStatus();
  if (device.is_cpu()) {
    std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }
#if defined(FSDPP_WITH_CUDA)
  if (device.is_cuda()) {
    cudaError_t e = cudaSetDevice(device.index());
    if (e == cudaSuccess) e = cudaMemset(dst, 0, bytes);
    if (e != cudaSuccess) {
      return absl::InternalError(absl::StrCat(
          "cudaMemset on ", device.ToString(), ": ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }
#endif
  return Unsupported("ZeroBytes", device, device);
}

}  // namespace fsdpp
