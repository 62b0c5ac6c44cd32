// The CUDA implementation of tensor/backend.h: CUDA kernels over the shared
// math in tensor/kernels/*.h (the very functions the CPU backend runs, so the
// two agree to rounding), and cuBLASLt for matmul.
//
// Plain C++ (no CUDA types or syntax) so that host-compiled code such as
// tensor/ops.cc can include it. The namespace is `gpu`, not `cuda`, because
// libcu++ owns ::cuda and a fsdpp::cuda would shadow it inside fsdpp.
#ifndef FSDPP_TENSOR_CUDA_CUDA_BACKEND_H_
#define FSDPP_TENSOR_CUDA_CUDA_BACKEND_H_

#include "tensor/backend.h"

namespace fsdpp {
namespace gpu {

// The backend of GPU `device`, created on first use (thread-safe) and alive
// for the whole process. Kernels run on the legacy default stream; each call
// makes `device` current first. An invalid `device` still yields a backend,
// whose calls then fail with the cudaSetDevice error.
Backend* CudaBackend(int device);

}  // namespace gpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CUDA_CUDA_BACKEND_H_
