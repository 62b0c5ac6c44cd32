// cuDNN status conversion and the owning descriptor; see cudnn_util.h.
#include "tensor/cuda/cudnn_util.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdpp {
namespace gpu {

absl::Status CudnnStatus(cudnnStatus_t status, const char* expr) {
  if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  char detail[1024] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  absl::StatusCode code;
  if (status == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      status == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED) {
    code = absl::StatusCode::kResourceExhausted;
  } else {
    switch (CUDNN_STATUS_CATEGORY(status)) {
      case CUDNN_STATUS_BAD_PARAM:
        code = absl::StatusCode::kInvalidArgument;
        break;
      case CUDNN_STATUS_NOT_SUPPORTED:
        code = absl::StatusCode::kUnimplemented;
        break;
      default:
        code = absl::StatusCode::kInternal;
    }
  }
  std::string message = absl::StrCat(expr, ": ", cudnnGetErrorString(status));
  if (detail[0] != '\0') absl::StrAppend(&message, ": ", detail);
  return absl::Status(code, message);
}

absl::StatusOr<CudnnDescriptor> CudnnDescriptor::Create(
    cudnnBackendDescriptorType_t type) {
  cudnnBackendDescriptor_t descriptor = nullptr;
  absl::Status status =
      CudnnStatus(cudnnBackendCreateDescriptor(type, &descriptor),
                  "cudnnBackendCreateDescriptor");
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(status.message(), " (descriptor type ",
                                     static_cast<int>(type), ")"));
  }
  return CudnnDescriptor(descriptor);
}

CudnnDescriptor::CudnnDescriptor(CudnnDescriptor&& other) noexcept
    : descriptor_(std::exchange(other.descriptor_, nullptr)) {}

CudnnDescriptor& CudnnDescriptor::operator=(CudnnDescriptor&& other) noexcept {
  if (this != &other) {
    if (descriptor_ != nullptr) cudnnBackendDestroyDescriptor(descriptor_);
    descriptor_ = std::exchange(other.descriptor_, nullptr);
  }
  return *this;
}

CudnnDescriptor::~CudnnDescriptor() {
  if (descriptor_ != nullptr) cudnnBackendDestroyDescriptor(descriptor_);
}

}  // namespace gpu
}  // namespace fsdpp
