// See cudnn_attention.h.
#include "tensor/cuda/cudnn_attention.h"

#include <cuda_runtime_api.h>
#include <cudnn_graph.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/cuda_runtime.h"
#include "core/status.h"
#include "tensor/cuda/cudnn_sdpa.h"
#include "tensor/cuda/cudnn_util.h"

namespace fsdpp {
namespace gpu {
namespace {

bool DisabledByEnvironment() {
  const char* value = std::getenv("FSDPP_CUDNN_ATTENTION");
  return value != nullptr && std::strcmp(value, "0") == 0;
}

SdpaShape ShapeOf(const AttentionCall& c) {
  SdpaShape s;
  s.dtype = c.dtype;
  s.q = BhtdTensor(c.b, c.h, c.t, c.hd);
  s.k = BhtdTensor(c.b, c.kv, c.t, c.hd);
  s.v = s.k;
  s.o = s.q;
  s.scale = c.scale;
  return s;
}

SdpaBackwardShape BackwardShapeOf(const AttentionCall& c) {
  SdpaBackwardShape s;
  s.forward = ShapeOf(c);
  s.d_o = s.forward.q;
  s.d_q = s.forward.q;
  s.d_k = s.forward.k;
  s.d_v = s.forward.k;
  s.deterministic = true;
  return s;
}

}  // namespace

class CudnnAttention::Impl {
 public:
  explicit Impl(int device) : device_(device) {}

  // Runs the plan `get_plan` gives (built on first use); false when it
  // cannot be built here.
  template <typename GetPlan>
  absl::StatusOr<bool> Run(bool backward, GetPlan get_plan,
                           const SdpaPointers& pointers) {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_[backward]) return false;
    FSDPP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (handle_ == nullptr) {
      const absl::Status created = CreateHandle();
      if (!created.ok()) return Refuse(backward, created);
    }
    absl::StatusOr<const SdpaPlan*> plan = get_plan(cache_.get());
    if (!plan.ok()) return Refuse(backward, plan.status());
    const int64_t bytes = (*plan)->workspace_bytes();
    if (bytes > workspace_bytes_) {
      if (workspace_ != nullptr) {
        FSDPP_CUDA_RETURN_IF_ERROR(cudaFree(workspace_));
        workspace_ = nullptr;
        workspace_bytes_ = 0;
      }
      FSDPP_CUDA_RETURN_IF_ERROR(cudaMalloc(&workspace_, bytes));
      workspace_bytes_ = bytes;
    }
    FSDPP_RETURN_IF_ERROR(
        (*plan)->Execute(handle_, pointers, workspace_, cudaStreamLegacy));
    ++calls_;
    return true;
  }

  int64_t calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  absl::Status CreateHandle() {
    FSDPP_RETURN_IF_ERROR(CheckSdpaCudnnVersion(cudnnGetVersion(), true));
    cudnnHandle_t handle = nullptr;
    FSDPP_CUDNN_RETURN_IF_ERROR(cudnnCreate(&handle));
    FSDPP_CUDNN_RETURN_IF_ERROR(cudnnSetStream(handle, cudaStreamLegacy));
    handle_ = handle;
    cache_ = std::make_unique<SdpaPlanCache>(handle_);
    return absl::OkStatus();
  }

  // Says once why cuDNN does not run here; every later call in that
  // direction takes the backend's own kernel.
  bool Refuse(bool backward, const absl::Status& why) {
    refused_[backward] = true;
    std::fprintf(stderr,
                 "fsdpp: cuDNN attention %s unavailable on cuda:%d (%s); "
                 "using fsdpp's own attention kernel\n",
                 backward ? "backward" : "forward", device_,
                 why.ToString().c_str());
    if (handle_ == nullptr) refused_[0] = refused_[1] = true;
    return false;
  }

  const int device_;
  mutable std::mutex mu_;
  cudnnHandle_t handle_ = nullptr;
  std::unique_ptr<SdpaPlanCache> cache_;
  void* workspace_ = nullptr;
  int64_t workspace_bytes_ = 0;
  int64_t calls_ = 0;
  bool refused_[2] = {false, false};  // forward, backward
};

CudnnAttention::CudnnAttention(int device) : impl_(new Impl(device)) {}

CudnnAttention* CudnnAttention::ForDevice(int device) {
  static auto* mu = new std::mutex;
  static auto* instances =
      new std::unordered_map<int, std::unique_ptr<CudnnAttention>>;
  std::lock_guard<std::mutex> lock(*mu);
  std::unique_ptr<CudnnAttention>& instance = (*instances)[device];
  if (instance == nullptr) instance.reset(new CudnnAttention(device));
  return instance.get();
}

bool CudnnAttention::Applies(const AttentionCall& call, bool backward) {
  static const bool disabled = DisabledByEnvironment();
  if (disabled) return false;
  if (call.dtype != DType::kBF16 && call.dtype != DType::kF16) return false;
  if (call.hd % 8 != 0 || call.hd > kSdpaMaxHeadDim) return false;
  if (call.b <= 0 || call.t <= 0 || call.kv <= 0 || call.h % call.kv != 0) {
    return false;
  }
  return !backward || call.t > 1;
}

absl::StatusOr<bool> CudnnAttention::Forward(const AttentionCall& call,
                                             const void* q, const void* k,
                                             const void* v, void* out,
                                             float* lse) {
  const SdpaShape shape = ShapeOf(call);
  SdpaPointers p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = out;
  p.stats = lse;
  return impl_->Run(
      false, [&](SdpaPlanCache* cache) { return cache->Forward(shape); }, p);
}

absl::StatusOr<bool> CudnnAttention::Backward(const AttentionCall& call,
                                              const void* q, const void* k,
                                              const void* v, const void* out,
                                              const float* lse,
                                              const void* dout, void* dq,
                                              void* dk, void* dv) {
  const SdpaBackwardShape shape = BackwardShapeOf(call);
  SdpaPointers p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = const_cast<void*>(out);
  p.stats = const_cast<float*>(lse);
  p.d_o = dout;
  p.d_q = dq;
  p.d_k = dk;
  p.d_v = dv;
  return impl_->Run(
      true, [&](SdpaPlanCache* cache) { return cache->Backward(shape); }, p);
}

int64_t CudnnAttention::calls() const { return impl_->calls(); }

}  // namespace gpu
}  // namespace fsdpp
