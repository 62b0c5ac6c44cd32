// cuDNN backend-API plumbing (--config=cuda only): cudnnStatus_t as
// absl::Status, and an owning backend descriptor.
//
// Every cuDNN call goes through FSDPP_CUDNN_RETURN_IF_ERROR, so an error
// names the failing call as written (attribute names included), the status
// name and cuDNN's own last-error message, which says which check failed
// (cudnnGetErrorString alone only says "CUDNN_STATUS_BAD_PARAM").
#ifndef FSDPP_TENSOR_CUDA_CUDNN_UTIL_H_
#define FSDPP_TENSOR_CUDA_CUDNN_UTIL_H_

#include <cudnn_graph.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdpp {
namespace gpu {

// OK for CUDNN_STATUS_SUCCESS; otherwise a Status whose message is
// "<expr>: <cudnnGetErrorString>: <cudnnGetLastErrorString>". The code
// follows cuDNN's category: BAD_PARAM -> InvalidArgument, NOT_SUPPORTED ->
// Unimplemented, allocation failures -> ResourceExhausted, the rest Internal.
absl::Status CudnnStatus(cudnnStatus_t status, const char* expr);

#define FSDPP_CUDNN_RETURN_IF_ERROR(expr)                      \
  do {                                                         \
    ::absl::Status fsdpp_cudnn_status_ =                       \
        ::fsdpp::gpu::CudnnStatus((expr), #expr);              \
    if (!fsdpp_cudnn_status_.ok()) return fsdpp_cudnn_status_; \
  } while (0)

// Owns one cudnnBackendDescriptor_t (destroyed with the object). Move-only.
class CudnnDescriptor {
 public:
  // A new descriptor of `type`; the error names the type.
  static absl::StatusOr<CudnnDescriptor> Create(
      cudnnBackendDescriptorType_t type);

  CudnnDescriptor() = default;
  CudnnDescriptor(CudnnDescriptor&& other) noexcept;
  CudnnDescriptor& operator=(CudnnDescriptor&& other) noexcept;
  CudnnDescriptor(const CudnnDescriptor&) = delete;
  CudnnDescriptor& operator=(const CudnnDescriptor&) = delete;
  ~CudnnDescriptor();

  cudnnBackendDescriptor_t get() const { return descriptor_; }

 private:
  explicit CudnnDescriptor(cudnnBackendDescriptor_t descriptor)
      : descriptor_(descriptor) {}
  cudnnBackendDescriptor_t descriptor_ = nullptr;
};

}  // namespace gpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CUDA_CUDNN_UTIL_H_
