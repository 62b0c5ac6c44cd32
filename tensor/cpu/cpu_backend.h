// The CPU implementation of tensor/backend.h: OpenMP loops over the shared
// math in tensor/kernels/*.h, and oneDNN for matmul.
#ifndef FSDPP_TENSOR_CPU_CPU_BACKEND_H_
#define FSDPP_TENSOR_CPU_CPU_BACKEND_H_

#include "tensor/backend.h"

namespace fsdpp {
namespace cpu {

// The process-wide CPU backend.
Backend* CpuBackend();

}  // namespace cpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CPU_CPU_BACKEND_H_
