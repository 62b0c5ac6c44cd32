// Module tree, initialisation and hook dispatch; see module.h.
#include "nn/module.h"

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/memcpy.h"
#include "core/rng.h"
#include "core/status.h"
#include "tensor/ops.h"

namespace fsdpp {

uint64_t InitStreamId(const std::string& fully_qualified_name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64.
  for (unsigned char c : fully_qualified_name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

absl::Status InitSlice(const InitSpec& spec, uint64_t seed, uint64_t stream,
                       int64_t element_offset, Tensor* out) {
  if (!IsFloatingPoint(out->dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("InitSlice: ", out->ToString(), " is not a float tensor"));
  }
  if (out->is_meta()) return absl::OkStatus();
  const int64_t n = out->numel();
  std::vector<float> values(n);
  switch (spec.kind) {
    case InitSpec::Kind::kZeros:
      break;
    case InitSpec::Kind::kOnes:
      std::fill(values.begin(), values.end(), 1.0f);
      break;
    case InitSpec::Kind::kConstant:
      std::fill(values.begin(), values.end(), spec.a);
      break;
    case InitSpec::Kind::kNormal:
      FillNormal(seed, stream, element_offset, n, spec.a, spec.b,
                 values.data());
      break;
    case InitSpec::Kind::kTruncatedNormal:
      FillTruncatedNormal(seed, stream, element_offset, n, spec.a, spec.b,
                          spec.bound, values.data());
      break;
    case InitSpec::Kind::kUniform:
      FillUniform(seed, stream, element_offset, n, spec.a, spec.b,
                  values.data());
      break;
  }
  ASSIGN_OR_RETURN(Tensor host,
                   Tensor::FromFloats(out->shape(), values, out->dtype()));
  return CopyBytes(out->raw_data(), out->device(), host.raw_data(),
                   Device::Cpu(), host.nbytes());
}

absl::Status Parameter::EnsureGrad() {
  if (grad.defined()) return absl::OkStatus();
  ASSIGN_OR_RETURN(
      grad, Tensor::Zeros(shape, dtype, data.device(), MemoryTag::kGrads));
  return absl::OkStatus();
}

Parameter* Module::AddParameter(const std::string& name, Shape shape,
                                InitSpec init, DType dtype) {
  auto p = std::make_unique<Parameter>();
  p->shape = shape;
  p->dtype = dtype;
  p->init = init;
  absl::StatusOr<Tensor> meta = Tensor::Empty(
      std::move(shape), dtype, Device::Meta(), MemoryTag::kParams);
  CHECK_OK(meta.status());
  p->data = *std::move(meta);
  Parameter* raw = p.get();
  parameters_.emplace_back(name, std::move(p));
  return raw;
}

void Module::ShareParameter(const std::string& name, Parameter* parameter) {
  shared_.emplace_back(name, parameter);
}

std::vector<std::pair<std::string, Parameter*>> Module::LocalParameters()
    const {
  std::vector<std::pair<std::string, Parameter*>> out;
  for (const auto& [name, p] : parameters_) out.emplace_back(name, p.get());
  return out;
}

std::vector<std::pair<std::string, Parameter*>> Module::NamedParameters(
    const std::string& prefix) const {
  std::vector<std::pair<std::string, Parameter*>> out;
  std::set<const Parameter*> seen;
  std::function<void(const Module&, const std::string&)> walk =
      [&](const Module& m, const std::string& pre) {
        for (const auto& [name, p] : m.parameters_) {
          if (seen.insert(p.get()).second)
            out.emplace_back(pre + name, p.get());
        }
        for (const auto& [name, child] : m.children_) {
          walk(*child, name.empty() ? pre : pre + name + ".");
        }
      };
  walk(*this, prefix.empty() ? "" : prefix + ".");
  return out;
}

std::vector<std::pair<std::string, Parameter*>> Module::UsedParameters(
    const std::string& prefix) const {
  std::vector<std::pair<std::string, Parameter*>> out = NamedParameters(prefix);
  std::set<const Parameter*> seen;
  for (auto& [name, p] : out) seen.insert(p);
  std::function<void(const Module&, const std::string&)> walk =
      [&](const Module& m, const std::string& pre) {
        for (const auto& [name, p] : m.shared_) {
          if (seen.insert(p).second) out.emplace_back(pre + name, p);
        }
        for (const auto& [name, child] : m.children_) {
          walk(*child, name.empty() ? pre : pre + name + ".");
        }
      };
  walk(*this, prefix.empty() ? "" : prefix + ".");
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::NamedModules(
    const std::string& prefix) {
  std::vector<std::pair<std::string, Module*>> out = {{prefix, this}};
  for (const auto& [name, child] : children_) {
    const std::string child_prefix =
        name.empty() ? prefix : (prefix.empty() ? name : prefix + "." + name);
    for (auto& entry : child->NamedModules(child_prefix)) {
      out.push_back(std::move(entry));
    }
  }
  return out;
}

int64_t Module::NumParameters() const {
  int64_t n = 0;
  for (const auto& [name, p] : NamedParameters()) n += NumElements(p->shape);
  return n;
}

absl::Status Module::ToEmpty(Device device) {
  for (const auto& [name, p] : NamedParameters()) {
    if (!p->data.is_meta()) continue;
    ASSIGN_OR_RETURN(
        p->data, Tensor::Empty(p->shape, p->dtype, device, MemoryTag::kParams));
  }
  return absl::OkStatus();
}

absl::Status Module::InitWeights(uint64_t seed) {
  for (const auto& [name, p] : NamedParameters()) {
    if (p->data.is_meta()) {
      return absl::FailedPreconditionError(
          absl::StrCat("InitWeights: parameter '", name,
                       "' is still on the meta device (call ToEmpty first)"));
    }
    RETURN_IF_ERROR(
        Annotate(InitSlice(p->init, seed, InitStreamId(name), 0, &p->data),
                 absl::StrCat("initialising '", name, "'")));
  }
  return absl::OkStatus();
}

absl::Status Module::ZeroGrad(bool set_to_none) {
  for (const auto& [name, p] : NamedParameters()) {
    if (set_to_none) {
      p->grad = Tensor();
    } else if (p->grad.defined()) {
      RETURN_IF_ERROR(Zero(&p->grad));
    }
  }
  return absl::OkStatus();
}

absl::Status Module::RunHooks(std::vector<Hook>& hooks, Module& m) {
  for (Hook& hook : hooks) RETURN_IF_ERROR(hook(m));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Module::Forward(const Tensor& x) {
  RETURN_IF_ERROR(RunHooks(pre_forward_, *this));
  absl::StatusOr<Tensor> y = ForwardImpl(x);
  if (!y.ok()) return Annotate(y.status(), absl::StrCat(kind_, " forward"));
  RETURN_IF_ERROR(RunHooks(post_forward_, *this));
  return y;
}

absl::StatusOr<Tensor> Module::Backward(const Tensor& dy) {
  RETURN_IF_ERROR(RunHooks(pre_backward_, *this));
  absl::StatusOr<Tensor> dx = BackwardImpl(dy);
  if (!dx.ok()) return Annotate(dx.status(), absl::StrCat(kind_, " backward"));
  RETURN_IF_ERROR(RunHooks(post_backward_, *this));
  return dx;
}

void Module::ReleaseSavedTensors() {
  ReleaseSavedTensorsImpl();
  for (const auto& [name, child] : children_) child->ReleaseSavedTensors();
}

}  // namespace fsdpp
