// The GPUs this process sees, in every build: a CPU build (no CUDA) sees
// none and says why. What a program asks before it puts work on a GPU (the
// trainer's training.device: "cuda"): how many there are, their names (for
// the MFU peak's data-sheet table), and taking one for this process (the
// device for new work and its caching allocator).
#ifndef FSDPP_CORE_GPUS_H_
#define FSDPP_CORE_GPUS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdpp {

// Whether this binary was built with CUDA (bazel --config=cuda).
bool BuiltWithCuda();

// Visible GPUs: 0 in a CPU build or without a driver or device.
int GpuCount();

// The name of GPU `device` ("NVIDIA H100 80GB HBM3"). FailedPrecondition in
// a CPU build; InvalidArgument for a device that is not there.
absl::StatusOr<std::string> GpuName(int device);

// Makes GPU `device` this thread's current device and registers the
// cudaMalloc caching allocators. FailedPrecondition, saying what to do, in
// a CPU build or when `device` is not among the visible GPUs.
absl::Status UseGpu(int device);

}  // namespace fsdpp

#endif  // FSDPP_CORE_GPUS_H_
