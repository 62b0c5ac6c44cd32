// AdamW on local shards; see adamw.h.
//
// The CPU loop is OpenMP-parallel above a size threshold; every element is
// independent, so the result does not depend on the thread count. This file
// is compiled with -ffp-contract=off so the host never fuses the kernel's
// a * b + c into an FMA (the CUDA side is built with --fmad=false to match).
#include "optim/adamw.h"

#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/parallel.h"
#include "core/status.h"
#include "optim/adamw_simd.h"
#include "optim/kernels/adamw.h"
#include "tensor/ops.h"

#if defined(FSDPP_WITH_CUDA)
#include "optim/adamw_cuda.h"
#endif

namespace fsdpp {
namespace {

// The update over [0, n) with the vectorised kernel (bit-exact with
// kernels::AdamWElement), split across the OpenMP pool for large tensors.
void AdamWCpuLoop(const kernels::AdamWScalars& s, const float* grad,
                  float* param, float* exp_avg, float* exp_avg_sq,
                  DType copy_dtype, void* copy, int64_t n) {
  const int64_t copy_bytes = copy == nullptr ? 0 : DTypeSize(copy_dtype);
  ParallelChunks(n, [&](int64_t begin, int64_t end) {
    adamw_simd::Step(s, grad + begin, param + begin, exp_avg + begin,
                     exp_avg_sq + begin, copy_dtype,
                     copy == nullptr
                         ? nullptr
                         : static_cast<char*>(copy) + begin * copy_bytes,
                     end - begin);
  });
}

bool FiniteNonNegative(double x) { return std::isfinite(x) && x >= 0.0; }

absl::Status CheckOptions(const AdamWOptions& o) {
  if (!FiniteNonNegative(o.lr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdamW: lr must be finite and >= 0, got ", o.lr));
  }
  if (!FiniteNonNegative(o.eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdamW: eps must be finite and >= 0, got ", o.eps));
  }
  if (!FiniteNonNegative(o.weight_decay)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AdamW: weight_decay must be finite and >= 0, got ", o.weight_decay));
  }
  for (const auto& [what, beta] :
       {std::pair<const char*, double>{"beta1", o.beta1}, {"beta2", o.beta2}}) {
    if (!(beta >= 0.0 && beta < 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW: ", what, " must be in [0, 1), got ", beta));
    }
  }
  return absl::OkStatus();
}

bool HasPartial(const std::vector<Placement>& placements) {
  for (const Placement& p : placements) {
    if (p.is_partial()) return true;
  }
  return false;
}

// FailedPrecondition for devices this build cannot run the update on.
absl::Status CheckDevice(const std::string& name, Device device) {
#if defined(FSDPP_WITH_CUDA)
  (void)name;
  (void)device;
  return absl::OkStatus();
#else
  if (!device.is_cuda()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("AdamW: param '", name, "' is on ", device.ToString(),
                   ", which needs a build with --config=cuda"));
#endif
}

std::string StateName(const std::string& param, bool second_moment) {
  return absl::StrCat(param, second_moment ? ".exp_avg_sq" : ".exp_avg");
}

}  // namespace

bool DecayMatricesOnly(const std::string& /*name*/, const DTensor& param) {
  return param.shape().size() >= 2;
}

absl::StatusOr<AdamW> AdamW::Create(std::vector<AdamWParam> params,
                                    AdamWOptions options) {
  FSDPP_RETURN_IF_ERROR(CheckOptions(options));
  AdamW opt(std::move(options));
  std::set<std::string> names;
  for (AdamWParam& p : params) {
    if (p.name.empty()) {
      return absl::InvalidArgumentError("AdamW: a param has an empty name");
    }
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW: duplicate param name '", p.name, "'"));
    }
    if (p.param == nullptr || p.grad == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW: param '", p.name, "' has a null ",
                       p.param == nullptr ? "param" : "grad"));
    }
    if (p.param->mesh() == nullptr || !p.param->local().defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW: param '", p.name, "' is an undefined DTensor"));
    }
    if (p.param->dtype() != DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW: param '", p.name, "' must be an f32 master (",
                       p.param->ToString(), ")"));
    }
    if (HasPartial(p.param->placements())) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamW: param '", p.name, "' has a Partial placement (",
                       p.param->ToString(), ")"));
    }
    FSDPP_RETURN_IF_ERROR(CheckDevice(p.name, p.param->local().device()));
    Entry e;
    e.name = std::move(p.name);
    e.param = p.param;
    e.grad = p.grad;
    if (p.weight_decay.has_value()) {
      e.decay = *p.weight_decay;
    } else if (opt.options_.decay_filter) {
      e.decay = opt.options_.decay_filter(e.name, *e.param);
    }
    opt.entries_.push_back(std::move(e));
  }
  return opt;
}

absl::Status AdamW::Init() {
  if (initialized_) return absl::OkStatus();
  std::vector<std::pair<DTensor, DTensor>> state;
  for (const Entry& e : entries_) {
    const Tensor& local = e.param->local();
    DTensor moments[2];
    for (DTensor& moment : moments) {
      FSDPP_ASSIGN_OR_RETURN(
          Tensor zeros,
          Tensor::Zeros(local.shape(), DType::kF32, local.device(),
                        MemoryTag::kOptimizerState));
      FSDPP_ASSIGN_OR_RETURN(
          moment, DTensor::FromLocal(std::move(zeros), e.param->mesh(),
                                     e.param->placements(), e.param->shape()));
    }
    state.emplace_back(std::move(moments[0]), std::move(moments[1]));
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    entries_[i].exp_avg = std::move(state[i].first);
    entries_[i].exp_avg_sq = std::move(state[i].second);
  }
  initialized_ = true;
  return absl::OkStatus();
}

absl::Status AdamW::CheckForStep(const Entry& e) const {
  const DTensor& p = *e.param;
  const DTensor& g = *e.grad;
  const Tensor& local = p.local();
  if (!local.defined() || local.dtype() != DType::kF32 ||
      local.shape() != e.exp_avg.local().shape() ||
      local.device() != e.exp_avg.local().device()) {
    return absl::FailedPreconditionError(
        absl::StrCat("AdamW: param '", e.name, "' is now ", p.ToString(),
                     " but its state was made for ", e.exp_avg.ToString()));
  }
  if (g.mesh() != p.mesh() || g.placements() != p.placements() ||
      g.shape() != p.shape() || !g.local().defined() ||
      g.local().shape() != local.shape() ||
      g.local().device() != local.device() || g.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AdamW: grad of '", e.name, "' must be f32 with the ",
        "param's layout: grad ", g.ToString(), ", param ", p.ToString()));
  }
  if (e.copy != nullptr &&
      (!e.copy->defined() || !IsFloatingPoint(e.copy->dtype()) ||
       e.copy->numel() != local.numel() ||
       e.copy->device() != local.device())) {
    return absl::FailedPreconditionError(
        absl::StrCat("AdamW: compute copy of '", e.name, "' is now ",
                     e.copy->ToString(), ", param ", p.ToString()));
  }
  return CheckDevice(e.name, local.device());
}

absl::Status AdamW::UpdateEntry(const Entry& e, float grad_scale,
                                const StepGuard* guard) const {
  const Tensor& local = e.param->local();
  const int64_t n = local.numel();
  if (n == 0 || local.is_meta()) return absl::OkStatus();
  kernels::AdamWScalars s = kernels::AdamWScalars::Make(
      options_.lr, options_.beta1, options_.beta2, options_.eps,
      e.decay ? options_.weight_decay : 0.0, step_);
  s.grad_scale = grad_scale;
  const float* grad = static_cast<const float*>(e.grad->local().raw_data());
  float* param = static_cast<float*>(local.raw_data());
  float* m = static_cast<float*>(e.exp_avg.local().raw_data());
  float* v = static_cast<float*>(e.exp_avg_sq.local().raw_data());
  void* copy = e.copy != nullptr ? e.copy->raw_data() : nullptr;
  const DType copy_dtype = e.copy != nullptr ? e.copy->dtype() : DType::kF32;
  if (local.device().is_cuda()) {
#if defined(FSDPP_WITH_CUDA)
    gpu::DeviceGradScale device_guard;
    if (guard != nullptr) {
      device_guard.loss = static_cast<const float*>(guard->loss->raw_data());
      device_guard.norm_sq =
          static_cast<const float*>(guard->norm_sq->raw_data());
      device_guard.max_norm = guard->max_norm;
    }
    return gpu::AdamWStepCuda(local.device().index(), s, grad, param, m, v,
                              copy, copy_dtype, n, device_guard);
#else
    (void)guard;
    return CheckDevice(e.name, local.device());
#endif
  }
  if (copy != nullptr && copy_dtype != DType::kF32 &&
      copy_dtype != DType::kBF16 && copy_dtype != DType::kF16) {
    return absl::InternalError(
        absl::StrCat("AdamW: compute copy dtype ", DTypeName(copy_dtype)));
  }
  AdamWCpuLoop(s, grad, param, m, v, copy_dtype, copy, n);
  return absl::OkStatus();
}

absl::Status AdamW::StepWith(
    const std::function<absl::Status(const Entry&)>& update) {
  FSDPP_RETURN_IF_ERROR(Init());
  for (const Entry& e : entries_) FSDPP_RETURN_IF_ERROR(CheckForStep(e));
  ++step_;
  for (const Entry& e : entries_) FSDPP_RETURN_IF_ERROR(update(e));
  return absl::OkStatus();
}

absl::Status AdamW::Step(float grad_scale) {
  if (!(grad_scale > 0.0f) || !std::isfinite(grad_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AdamW: grad_scale must be finite and > 0, got ", grad_scale));
  }
  return StepWith([&](const Entry& e) { return UpdateEntry(e, grad_scale); });
}

absl::Status AdamW::Step(const StepGuard& guard) {
  if (!(guard.max_norm >= 0.0) || !std::isfinite(guard.max_norm)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AdamW: the guard's max_norm must be finite and >= 0, got ",
        guard.max_norm));
  }
  const Device device = entries_.empty()
                            ? Device::Meta()
                            : entries_.front().param->local().device();
  for (const auto& [what, t] :
       {std::pair<const char*, const Tensor*>{"loss", guard.loss},
        {"norm_sq", guard.norm_sq}}) {
    if (t == nullptr || !t->defined() || t->dtype() != DType::kF32 ||
        t->numel() != 1 || (!entries_.empty() && t->device() != device)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AdamW: the guard's ", what,
          " must be an f32 tensor of one element on the params' device (",
          device.ToString(), "), got ",
          t == nullptr ? std::string("null") : t->ToString()));
    }
  }
  if (device.is_cuda()) {
    return StepWith(
        [&](const Entry& e) { return UpdateEntry(e, 1.0f, &guard); });
  }
  // On the host the values are read where they are (a meta step has none:
  // it updates nothing either).
  float grad_scale = 1.0f;
  const bool apply = !device.is_meta() &&
                     kernels::GuardedGradScale(
                         *static_cast<const float*>(guard.loss->raw_data()),
                         *static_cast<const float*>(guard.norm_sq->raw_data()),
                         guard.max_norm, &grad_scale);
  return StepWith([&](const Entry& e) {
    return apply ? UpdateEntry(e, grad_scale) : absl::OkStatus();
  });
}

AdamW::Entry* AdamW::Find(const std::string& name) {
  for (Entry& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::StatusOr<bool> AdamW::DecaysWeight(const std::string& name) const {
  for (const Entry& e : entries_) {
    if (e.name == name) return e.decay;
  }
  return absl::NotFoundError(absl::StrCat("AdamW: no param '", name, "'"));
}

absl::Status AdamW::SetComputeCopy(const std::string& name, Tensor* copy) {
  Entry* e = Find(name);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat("AdamW: no param '", name, "'"));
  }
  if (copy == nullptr) {
    e->copy = nullptr;
    return absl::OkStatus();
  }
  const Tensor& local = e->param->local();
  if (!copy->defined() || !IsFloatingPoint(copy->dtype()) ||
      copy->numel() != local.numel() || copy->device() != local.device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AdamW: compute copy of '", name, "' must be a float ",
        "tensor with the local shard's ", local.numel(), " elements on ",
        local.device().ToString(), ", got ", copy->ToString()));
  }
  FSDPP_RETURN_IF_ERROR(Copy(local, copy));
  e->copy = copy;
  return absl::OkStatus();
}

absl::StatusOr<OptimizerStateDict> AdamW::StateDict() {
  FSDPP_RETURN_IF_ERROR(Init());
  OptimizerStateDict state;
  for (const Entry& e : entries_) {
    state.tensors.emplace(StateName(e.name, false), e.exp_avg);
    state.tensors.emplace(StateName(e.name, true), e.exp_avg_sq);
  }
  state.scalars.emplace("step", step_);
  return state;
}

absl::Status AdamW::LoadStateDict(const OptimizerStateDict& state) {
  FSDPP_RETURN_IF_ERROR(Init());
  // Names first: exactly the expected ones.
  std::set<std::string> expected;
  for (const Entry& e : entries_) {
    expected.insert(StateName(e.name, false));
    expected.insert(StateName(e.name, true));
  }
  std::vector<std::string> missing, unexpected;
  for (const std::string& name : expected) {
    if (state.tensors.count(name) == 0) missing.push_back(name);
  }
  for (const auto& [name, tensor] : state.tensors) {
    if (expected.count(name) == 0) unexpected.push_back(name);
  }
  if (state.scalars.count("step") == 0) missing.push_back("step");
  for (const auto& [name, value] : state.scalars) {
    if (name != "step") unexpected.push_back(name);
  }
  if (!missing.empty() || !unexpected.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AdamW::LoadStateDict: missing [", absl::StrJoin(missing, ", "),
        "], unexpected [", absl::StrJoin(unexpected, ", "), "]"));
  }
  const int64_t step = state.scalars.at("step");
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdamW::LoadStateDict: step ", step, " is negative"));
  }
  // Then every tensor, brought to our layout (this may communicate), before
  // anything is written.
  std::vector<std::pair<DTensor*, DTensor>> writes;
  for (Entry& e : entries_) {
    for (bool second : {false, true}) {
      const std::string name = StateName(e.name, second);
      const DTensor& src = state.tensors.at(name);
      DTensor* dst = second ? &e.exp_avg_sq : &e.exp_avg;
      if (src.mesh() != dst->mesh() || src.shape() != dst->shape() ||
          !IsFloatingPoint(src.dtype())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "AdamW::LoadStateDict: '", name, "' is ", src.ToString(), " on ",
            src.mesh() ? src.mesh()->ToString() : "no mesh",
            "; expected a float ", ShapeToString(dst->shape()), " on ",
            dst->mesh()->ToString()));
      }
      DTensor laid_out = src;
      if (src.placements() != dst->placements()) {
        FSDPP_ASSIGN_OR_RETURN(laid_out, src.Redistribute(dst->placements()));
      }
      writes.emplace_back(dst, std::move(laid_out));
    }
  }
  for (auto& [dst, src] : writes) {
    FSDPP_RETURN_IF_ERROR(Copy(src.local(), dst->mutable_local()));
  }
  step_ = step;
  return absl::OkStatus();
}

absl::Status AdamW::SetStep(int64_t step) {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdamW::SetStep: step must be >= 0, got ", step));
  }
  step_ = step;
  return absl::OkStatus();
}

absl::Status AdamW::SetLr(double lr) {
  if (!FiniteNonNegative(lr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdamW: lr must be finite and >= 0, got ", lr));
  }
  options_.lr = lr;
  return absl::OkStatus();
}

}  // namespace fsdpp
