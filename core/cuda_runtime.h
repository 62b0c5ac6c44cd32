// CUDA streams, events and the device caching allocator (--config=cuda only).
//
// CudaStream / CudaEvent implement the Stream / Event interfaces of
// core/stream.h over cudaStream_t / cudaEvent_t, so comm and tensor code treat
// CPU and GPU streams alike. Host waits poll cudaEventQuery with a timeout
// (never an unbounded cudaEventSynchronize). A CUDA stream waiting on a
// non-CUDA event blocks in a host function, with the stream's wait timeout.
#ifndef FSDPP_CORE_CUDA_RUNTIME_H_
#define FSDPP_CORE_CUDA_RUNTIME_H_

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/allocator.h"
#include "core/stream.h"

namespace fsdpp {

// Turns a cudaError_t into a Status naming the failing expression.
absl::Status CudaStatus(cudaError_t error, const char* expr);

#define FSDPP_CUDA_RETURN_IF_ERROR(expr)                                    \
  do {                                                                      \
    ::absl::Status fsdpp_cuda_status_ = ::fsdpp::CudaStatus((expr), #expr); \
    if (!fsdpp_cuda_status_.ok()) return fsdpp_cuda_status_;                \
  } while (0)

// Number of visible GPUs (0 when there is no driver or device).
int CudaDeviceCount();

class CudaEvent final : public Event {
 public:
  // Records on `stream` (on its device).
  static absl::StatusOr<std::shared_ptr<CudaEvent>> RecordOn(
      cudaStream_t stream, int device, std::string name);
  ~CudaEvent() override;
  bool IsCompleted() const override;
  absl::Status Wait(absl::Duration timeout) const override;
  std::string name() const override { return name_; }
  void* cuda_event_handle() const override { return event_; }
  cudaEvent_t get() const { return event_; }

 private:
  CudaEvent(cudaEvent_t event, int device, std::string name)
      : event_(event), device_(device), name_(std::move(name)) {}
  cudaEvent_t event_;
  int device_;
  std::string name_;
};

class CudaStream final : public Stream {
 public:
  // A new non-blocking stream on GPU `device`.
  static absl::StatusOr<std::unique_ptr<CudaStream>> Create(
      int device, std::string name,
      absl::Duration wait_timeout = kDefaultStreamWaitTimeout);
  ~CudaStream() override;

  Device device() const override { return Device::Cuda(device_); }
  const std::string& name() const override { return name_; }
  std::shared_ptr<Event> Record() override;
  void WaitEvent(std::shared_ptr<Event> event) override;
  absl::Status Synchronize(absl::Duration timeout) override;
  absl::Status status() const override;
  cudaStream_t get() const { return stream_; }

 private:
  CudaStream(cudaStream_t stream, int device, std::string name,
             absl::Duration wait_timeout)
      : stream_(stream),
        device_(device),
        name_(std::move(name)),
        wait_timeout_(wait_timeout) {}
  void SetError(const absl::Status& status);

  cudaStream_t stream_;
  int device_;
  std::string name_;
  absl::Duration wait_timeout_;
  uint64_t next_event_ = 0;
  mutable std::mutex mu_;
  absl::Status error_;
};

// Registers a caching allocator over cudaMalloc for every visible GPU with
// SetAllocator (idempotent). Returns the number of devices registered.
int RegisterCudaAllocators();

}  // namespace fsdpp

#endif  // FSDPP_CORE_CUDA_RUNTIME_H_
