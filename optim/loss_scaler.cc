// Dynamic loss scaling; see loss_scaler.h.
//
// Unscale and the inf/NaN check are one fused pass per gradient
// (kernels::UnscaleElement: an OpenMP loop on the CPU, a CUDA kernel on a
// GPU); on a GPU the per-tensor findings accumulate in one device flag that
// is read back once.
#include "optim/loss_scaler.h"

#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "optim/kernels/adamw.h"

#if defined(FSDPP_WITH_CUDA)
#include "optim/adamw_cuda.h"
#endif

namespace fsdpp {
namespace {

// Below this many elements the loop runs on the calling thread.
constexpr int64_t kParallelElements = 1 << 15;

// grad *= inv_scale; true when any element was inf or NaN.
bool UnscaleCpu(float* grad, int64_t n, float inv_scale) {
  bool found = false;
#pragma omp parallel for schedule(static) \
    reduction(||                          \
              : found) if (n > kParallelElements)
  for (int64_t i = 0; i < n; ++i) {
    bool element_found = false;
    grad[i] = kernels::UnscaleElement(grad[i], inv_scale, &element_found);
    found = found || element_found;
  }
  return found;
}

absl::Status CheckGrads(const std::vector<DTensor*>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const DTensor* g = grads[i];
    if (g == nullptr || g->mesh() == nullptr || !g->local().defined()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LossScaler::UnscaleAndCheck: grad ", i, " is null or undefined"));
    }
    if (g->mesh() != grads[0]->mesh() || g->dtype() != DType::kF32 ||
        g->local().is_meta() ||
        g->local().device() != grads[0]->local().device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LossScaler::UnscaleAndCheck: grad ", i, " (", g->ToString(),
          ") must be f32 on grad 0's mesh and device (not meta)"));
    }
#if !defined(FSDPP_WITH_CUDA)
    if (g->local().device().is_cuda()) {
      return absl::FailedPreconditionError(
          absl::StrCat("LossScaler::UnscaleAndCheck: grad ", i, " is on ",
                       g->local().device().ToString(),
                       ", which needs a build with --config=cuda"));
    }
#endif
  }
  return absl::OkStatus();
}

// Unscales every grad; returns whether this rank saw an inf or NaN.
absl::StatusOr<bool> UnscaleLocal(const std::vector<DTensor*>& grads,
                                  float inv_scale) {
#if defined(FSDPP_WITH_CUDA)
  const Device device = grads[0]->local().device();
  if (device.is_cuda()) {
    FSDPP_ASSIGN_OR_RETURN(Tensor flag,
                           Tensor::Zeros({1}, DType::kI32, device));
    for (DTensor* g : grads) {
      FSDPP_RETURN_IF_ERROR(gpu::UnscaleCuda(
          device.index(), static_cast<float*>(g->local().raw_data()),
          g->local().numel(), inv_scale, flag.data<int32_t>()));
    }
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> found, flag.ToFloats());
    return found[0] != 0.0f;
  }
#endif
  bool found = false;
  for (DTensor* g : grads) {
    if (UnscaleCpu(static_cast<float*>(g->local().raw_data()),
                   g->local().numel(), inv_scale)) {
      found = true;
    }
  }
  return found;
}

}  // namespace

absl::StatusOr<LossScaler> LossScaler::Create(const LossScalerOptions& o) {
  if (!std::isfinite(o.init_scale) || !(o.init_scale > 0.0) ||
      !std::isfinite(static_cast<float>(o.init_scale))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LossScaler: init_scale must be finite (in f32) and > 0, got ",
        o.init_scale));
  }
  if (!(o.growth_factor > 1.0) || !std::isfinite(o.growth_factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LossScaler: growth_factor must be finite and > 1, got ",
                     o.growth_factor));
  }
  if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LossScaler: backoff_factor must be in (0, 1), got ",
                     o.backoff_factor));
  }
  if (o.growth_interval < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LossScaler: growth_interval must be >= 1, got ", o.growth_interval));
  }
  return LossScaler(o);
}

absl::StatusOr<bool> LossScaler::UnscaleAndCheck(
    const std::vector<DTensor*>& grads, absl::Duration timeout) {
  if (grads.empty()) return true;
  FSDPP_RETURN_IF_ERROR(CheckGrads(grads));
  // torch: inv_scale = scale.double().reciprocal().float().
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  FSDPP_ASSIGN_OR_RETURN(bool found_local, UnscaleLocal(grads, inv_scale));

  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, grads[0]->mesh()->FlatGroup());
  FSDPP_ASSIGN_OR_RETURN(Tensor flag,
                         Tensor::FromFloats({1}, {found_local ? 1.0f : 0.0f},
                                            DType::kF32, group->device()));
  FSDPP_ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      group->AllReduce(Buffer{flag.raw_data(), 1, DType::kF32, flag.device()},
                       ReduceOp::kMax));
  FSDPP_RETURN_IF_ERROR(work->Wait(timeout));
  FSDPP_ASSIGN_OR_RETURN(std::vector<float> found_any, flag.ToFloats());
  return found_any[0] == 0.0f;
}

void LossScaler::Update(bool found_inf) {
  // torch's _amp_update_scale_: the scale is f32, the factors double.
  if (found_inf) {
    scale_ = static_cast<float>(scale_ * options_.backoff_factor);
    growth_tracker_ = 0;
    return;
  }
  const int64_t successful = growth_tracker_ + 1;
  if (successful == options_.growth_interval) {
    const float grown = static_cast<float>(scale_ * options_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  } else {
    growth_tracker_ = successful;
  }
}

absl::Status LossScaler::Restore(float scale, int64_t growth_tracker) {
  if (!std::isfinite(scale) || !(scale > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LossScaler::Restore: scale must be finite and > 0, got ", scale));
  }
  if (growth_tracker < 0 || growth_tracker >= options_.growth_interval) {
    return absl::InvalidArgumentError(
        absl::StrCat("LossScaler::Restore: growth_tracker ", growth_tracker,
                     " is outside [0, ", options_.growth_interval, ")"));
  }
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  return absl::OkStatus();
}

}  // namespace fsdpp
