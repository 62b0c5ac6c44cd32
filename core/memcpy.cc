// Host/device byte movement; see memcpy.h.
#include "core/memcpy.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/device_wait.h"

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

#if defined(FSDPP_WITH_CUDA)
constexpr absl::Duration kStagingTimeout = absl::Minutes(10);

absl::Status CudaError(cudaError_t e, const char* what, Device device) {
  return absl::InternalError(absl::StrCat(what, " on ", device.ToString(), ": ",
                                          cudaGetErrorString(e)));
}

// One pinned buffer and the event after the copy that last read it.
struct StagingSlot {
  void* pinned = nullptr;
  size_t capacity = 0;
  cudaEvent_t done = nullptr;
};

struct StagingRing {
  std::mutex mu;
  StagingSlot slots[kStagingSlots];
  int next = 0;
};

StagingRing& RingFor(int device) {
  static auto* mu = new std::mutex;
  static auto* rings =
      new std::unordered_map<int, std::unique_ptr<StagingRing>>;
  std::lock_guard<std::mutex> lock(*mu);
  std::unique_ptr<StagingRing>& ring = (*rings)[device];
  if (ring == nullptr) ring = std::make_unique<StagingRing>();
  return *ring;
}

// Waits, bounded, until the work queued so far on `device`'s legacy default
// stream has run.
absl::Status WaitForQueuedWork(Device device) {
  cudaError_t e = cudaSetDevice(device.index());
  if (e != cudaSuccess) return CudaError(e, "cudaSetDevice", device);
  cudaEvent_t event = nullptr;
  if ((e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming)) !=
      cudaSuccess) {
    return CudaError(e, "cudaEventCreateWithFlags", device);
  }
  absl::Status status;
  if ((e = cudaEventRecord(event, cudaStreamLegacy)) != cudaSuccess) {
    status = CudaError(e, "cudaEventRecord", device);
  } else {
    const absl::Time deadline = absl::Now() + kStagingTimeout;
    absl::Duration backoff = absl::Microseconds(1);
    while ((e = cudaEventQuery(event)) == cudaErrorNotReady) {
      cudaGetLastError();  // Not an error: clear it.
      if (absl::Now() >= deadline) {
        status = absl::DeadlineExceededError(absl::StrCat(
            "copy from ", device.ToString(), ": its queued work did not ",
            "finish within ", absl::FormatDuration(kStagingTimeout)));
        break;
      }
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Microseconds(20));
    }
    if (status.ok() && e != cudaSuccess) {
      status = CudaError(e, "waiting for queued work", device);
    }
  }
  cudaEventDestroy(event);
  return status;
}

// Waits, bounded, until `event` completed; a host sync only if it had not.
absl::Status WaitStaged(cudaEvent_t event, Device device) {
  const absl::Time deadline = absl::Now() + kStagingTimeout;
  bool counted = false;
  for (;;) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaError(e, "staging copy", device);
    cudaGetLastError();  // cudaErrorNotReady is not an error: clear it.
    if (!counted) {
      CountHostSync();
      counted = true;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("CopyBytesFromHostAsync: an earlier host-to-",
                       device.ToString(), " copy did not finish within ",
                       absl::FormatDuration(kStagingTimeout)));
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}
#endif

}  // namespace

absl::Status CopyBytesFromHostAsync(void* dst, Device dst_device,
                                    const void* src, size_t bytes) {
  if (!dst_device.is_cuda() || bytes > kMaxStagedBytes) {
    return CopyBytes(dst, dst_device, src, Device::Cpu(), bytes);
  }
  if (bytes == 0) return absl::OkStatus();
#if defined(FSDPP_WITH_CUDA)
  StagingRing& ring = RingFor(dst_device.index());
  std::lock_guard<std::mutex> lock(ring.mu);
  StagingSlot& slot = ring.slots[ring.next];
  ring.next = (ring.next + 1) % kStagingSlots;
  cudaError_t e = cudaSetDevice(dst_device.index());
  if (e != cudaSuccess) return CudaError(e, "cudaSetDevice", dst_device);
  if (slot.done != nullptr) {
    if (absl::Status s = WaitStaged(slot.done, dst_device); !s.ok()) return s;
  } else if ((e = cudaEventCreateWithFlags(
                  &slot.done, cudaEventDisableTiming)) != cudaSuccess) {
    slot.done = nullptr;
    return CudaError(e, "cudaEventCreateWithFlags", dst_device);
  }
  if (slot.capacity < bytes) {
    if (slot.pinned != nullptr) cudaFreeHost(slot.pinned);
    slot.pinned = nullptr;
    slot.capacity = 0;
    if ((e = cudaMallocHost(&slot.pinned, bytes)) != cudaSuccess) {
      slot.pinned = nullptr;
      return CudaError(e, "cudaMallocHost (staging)", dst_device);
    }
    slot.capacity = bytes;
  }
  std::memcpy(slot.pinned, src, bytes);
  if ((e = cudaMemcpyAsync(dst, slot.pinned, bytes, cudaMemcpyHostToDevice,
                           cudaStreamLegacy)) != cudaSuccess) {
    return CudaError(e, "cudaMemcpyAsync (staged)", dst_device);
  }
  if ((e = cudaEventRecord(slot.done, cudaStreamLegacy)) != cudaSuccess) {
    return CudaError(e, "cudaEventRecord (staging)", dst_device);
  }
  return absl::OkStatus();
#else
  return CopyBytes(dst, dst_device, src, Device::Cpu(), bytes);
#endif
}

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
  if (dst_device.is_cpu() != src_device.is_cpu()) CountHostSync();
  if (src_device.is_cuda() && dst_device.is_cpu()) {
    // The copy waits for the GPU's queued work: wait for it first, bounded,
    // so that a stuck collective is an error rather than a hang.
    if (absl::Status s = WaitForQueuedWork(src_device); !s.ok()) return s;
  }
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
