// See device_wait.h.
#include "core/device_wait.h"

#include <atomic>

#include "absl/strings/str_cat.h"

#if defined(FSDPP_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace fsdpp {
namespace {

std::atomic<int64_t> host_syncs{0};

}  // namespace

absl::Status ComputeStreamWaitEvent(Device device, void* cuda_event) {
  if (!device.is_cuda() || cuda_event == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ComputeStreamWaitEvent: needs a CUDA device and a CUDA event; got ",
        device.ToString(), cuda_event == nullptr ? " and no event" : ""));
  }
#if defined(FSDPP_WITH_CUDA)
  cudaError_t e = cudaSetDevice(device.index());
  if (e == cudaSuccess) {
    e = cudaStreamWaitEvent(cudaStreamLegacy,
                            static_cast<cudaEvent_t>(cuda_event), 0);
  }
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamWaitEvent on ",
                                            device.ToString(), ": ",
                                            cudaGetErrorString(e)));
  }
  return absl::OkStatus();
#else
  return absl::UnimplementedError(
      "ComputeStreamWaitEvent: this build has no CUDA support");
#endif
}

void CountHostSync() { host_syncs.fetch_add(1, std::memory_order_relaxed); }

int64_t HostSyncCount() { return host_syncs.load(std::memory_order_relaxed); }

}  // namespace fsdpp
