// CUDA streams, events and allocators; see cuda_runtime.h.
#include "core/cuda_runtime.h"

#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/caching_allocator.h"
#include "core/device_wait.h"
#include "core/logging.h"

namespace fsdpp {

absl::Status CudaStatus(cudaError_t error, const char* expr) {
  if (error == cudaSuccess) return absl::OkStatus();
  absl::StatusCode code = error == cudaErrorMemoryAllocation
                              ? absl::StatusCode::kResourceExhausted
                              : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(expr, ": ", cudaGetErrorName(error),
                                         ": ", cudaGetErrorString(error)));
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // Clear the sticky "no driver" error.
    return 0;
  }
  return count;
}

absl::StatusOr<std::shared_ptr<CudaEvent>> CudaEvent::RecordOn(
    cudaStream_t stream, int device, std::string name) {
  FSDPP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaEvent_t event;
  FSDPP_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  absl::Status s =
      CudaStatus(cudaEventRecord(event, stream), "cudaEventRecord");
  if (!s.ok()) {
    cudaEventDestroy(event);
    return s;
  }
  return std::shared_ptr<CudaEvent>(
      new CudaEvent(event, device, std::move(name)));
}

CudaEvent::~CudaEvent() { cudaEventDestroy(event_); }

bool CudaEvent::IsCompleted() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) cudaGetLastError();  // Not an error: clear it.
  return e != cudaErrorNotReady;
}

absl::Status CudaEvent::Wait(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Microseconds(2);
  for (bool first = true;; first = false) {
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return absl::OkStatus();
    // A host sync only when the host does wait (not for a completed event).
    if (first) CountHostSync();
    if (e == cudaErrorNotReady) cudaGetLastError();  // Not an error: clear it.
    if (e != cudaErrorNotReady) {
      return CudaStatus(e, absl::StrCat("cudaEventQuery(", name_, ")").c_str());
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("event ", name_, " did not complete within ",
                       absl::FormatDuration(timeout)));
    }
    absl::SleepFor(backoff);
    // Short sleeps: a GPU step's waits are often tens of microseconds, and
    // each one the host oversleeps is time the GPU's queue runs dry.
    backoff = std::min(backoff * 2, absl::Microseconds(50));
  }
}

absl::StatusOr<std::unique_ptr<CudaStream>> CudaStream::Create(
    int device, std::string name, absl::Duration wait_timeout) {
  FSDPP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaStream_t stream;
  FSDPP_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::unique_ptr<CudaStream>(
      new CudaStream(stream, device, std::move(name), wait_timeout));
}

CudaStream::~CudaStream() {
  absl::Status s = Synchronize(wait_timeout_);
  LOG_IF(ERROR, !s.ok()) << "destroying stream " << name_ << ": " << s;
  cudaStreamDestroy(stream_);
}

void CudaStream::SetError(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_.ok()) error_ = status;
}

absl::Status CudaStream::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::shared_ptr<Event> CudaStream::Record() {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = next_event_++;
  }
  auto event =
      CudaEvent::RecordOn(stream_, device_, absl::StrCat(name_, "#", seq));
  if (!event.ok()) {
    SetError(event.status());
    return HostEvent();
  }
  return *std::move(event);
}

namespace {

struct HostWait {
  std::shared_ptr<Event> event;
  absl::Duration timeout;
  CudaStream* stream;
  std::function<void(const absl::Status&)> on_error;
};

void CUDART_CB RunHostWait(void* arg) {
  std::unique_ptr<HostWait> wait(static_cast<HostWait*>(arg));
  absl::Status s = wait->event->Wait(wait->timeout);
  if (!s.ok()) wait->on_error(s);
}

}  // namespace

void CudaStream::WaitEvent(std::shared_ptr<Event> event) {
  if (event->IsCompleted() && event->Wait(absl::ZeroDuration()).ok()) return;
  if (auto* cuda_event = dynamic_cast<CudaEvent*>(event.get())) {
    absl::Status s =
        CudaStatus(cudaStreamWaitEvent(stream_, cuda_event->get(), 0),
                   "cudaStreamWaitEvent");
    if (!s.ok()) SetError(s);
    return;
  }
  auto* wait = new HostWait{
      event, wait_timeout_, this, [this](const absl::Status& s) {
        SetError(absl::Status(
            s.code(),
            absl::StrCat("stream ", name_, " waiting: ", s.message())));
      }};
  absl::Status s = CudaStatus(cudaLaunchHostFunc(stream_, RunHostWait, wait),
                              "cudaLaunchHostFunc");
  if (!s.ok()) {
    delete wait;
    SetError(s);
  }
}

absl::Status CudaStream::Synchronize(absl::Duration timeout) {
  std::shared_ptr<Event> event = Record();
  absl::Status s = event->Wait(timeout);
  if (!s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("stream ", name_, ": ", s.message()));
  }
  return status();
}

namespace {

class CudaRawAllocator final : public RawAllocator {
 public:
  explicit CudaRawAllocator(int device) : device_(device) {}
  Device device() const override { return Device::Cuda(device_); }
  void* Alloc(size_t bytes) override {
    void* ptr = nullptr;
    if (cudaSetDevice(device_) != cudaSuccess ||
        cudaMalloc(&ptr, bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return ptr;
  }
  void Free(void* ptr) override {
    cudaSetDevice(device_);
    cudaError_t e = cudaFree(ptr);
    LOG_IF(ERROR, e != cudaSuccess) << "cudaFree: " << cudaGetErrorString(e);
  }

 private:
  int device_;
};

}  // namespace

int RegisterCudaAllocators() {
  static std::once_flag once;
  static int count = 0;
  std::call_once(once, [] {
    count = CudaDeviceCount();
    for (int d = 0; d < count; ++d) {
      // Process-lifetime allocators: tensors may be freed during exit.
      SetAllocator(new CachingAllocator(std::make_unique<CudaRawAllocator>(d)));
    }
  });
  return count;
}

}  // namespace fsdpp
