// Ordering GPU work after a CUDA event without blocking the host, and a
// count of the times the host did block on a GPU.
//
// FSDP waits for its all-gathers and reduce-scatters the way FSDP2 does: the
// compute stream (each CUDA device's legacy default stream, where fsdpp's
// kernels run) waits on the collective's CUDA event, so the host keeps
// enqueueing work instead of sleeping until the GPU drains
// (comm::Work::WaitForCompute). Host syncs are counted so that a test can
// assert that a training step has none except the loss it reads back.
#ifndef FSDPP_CORE_DEVICE_WAIT_H_
#define FSDPP_CORE_DEVICE_WAIT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/device.h"

namespace fsdpp {

// Work enqueued on CUDA device `device`'s legacy default stream after this
// call starts only once `cuda_event` (a cudaEvent_t) has completed; the host
// does not wait. InvalidArgument for a non-CUDA device or a null event;
// Unimplemented in a build without CUDA.
absl::Status ComputeStreamWaitEvent(Device device, void* cuda_event);

// Counts one host sync: the host blocked until GPU work finished (a copy
// between the host and a GPU, a host wait on a CUDA event or stream that had
// not completed yet; a wait that finds its event complete does not count).
void CountHostSync();
// Host syncs counted so far in this process (all threads).
int64_t HostSyncCount();

}  // namespace fsdpp

#endif  // FSDPP_CORE_DEVICE_WAIT_H_
