// Byte copies and fills between host and device memory.
//
// The one place that knows how to move bytes between device types (memcpy on
// the host, cudaMemcpy under --config=cuda), so Tensor and the collectives can
// stage data without depending on the kernel libraries. Synchronous: returns
// when the bytes are in place; except CopyBytesFromHostAsync, which returns
// once the source may be reused.
#ifndef FSDPP_CORE_MEMCPY_H_
#define FSDPP_CORE_MEMCPY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "core/device.h"

namespace fsdpp {

// Copies `bytes` from `src` on `src_device` to `dst` on `dst_device`.
// Meta devices hold no bytes: a copy from meta to meta does nothing (a dry
// run, plan/), one between meta and a real device is an InvalidArgument
// error unless `bytes` is 0.
absl::Status CopyBytes(void* dst, Device dst_device, const void* src,
                       Device src_device, size_t bytes);

// A host-to-GPU copy that does not wait for the GPU: the bytes are staged in
// pinned host memory (a ring of kStagingSlots buffers per GPU) and copied by
// cudaMemcpyAsync on the GPU's legacy default stream, so the work enqueued
// there after this call sees them (other streams must wait on it). `src` may
// be reused once this returns. The host waits only when the ring's oldest
// copy is still pending (a counted host sync). For a destination that is not
// a GPU, or more than kMaxStagedBytes, this is CopyBytes.
inline constexpr int kStagingSlots = 8;
inline constexpr size_t kMaxStagedBytes = size_t{16} << 20;
absl::Status CopyBytesFromHostAsync(void* dst, Device dst_device,
                                    const void* src, size_t bytes);

// Sets `bytes` bytes at `dst` on `device` to zero (nothing on meta).
absl::Status ZeroBytes(void* dst, Device device, size_t bytes);

}  // namespace fsdpp

#endif  // FSDPP_CORE_MEMCPY_H_
