// Module tree, initialisation and hook dispatch; see module.h.
#include "nn/module.h"

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/memcpy.h"
#include "core/rng.h"
#include "core/status.h"
#include "tensor/ops.h"
#include "tensor/sharding.h"

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
  if (out->is_meta()) {
    // Nothing to write; a dry run (plan/) still sees the staging tensor the
    // real path below allocates, where it would: on the host.
    return Tensor::Empty(out->shape(), out->dtype(), StagingHost(out->device()))
        .status();
  }
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
  FSDPP_ASSIGN_OR_RETURN(
      Tensor host, Tensor::FromFloats(out->shape(), values, out->dtype()));
  return CopyBytes(out->raw_data(), out->device(), host.raw_data(),
                   Device::Cpu(), host.nbytes());
}

absl::Status Parameter::EnsureGrad(bool zeroed) {
  if (grad.defined()) return absl::OkStatus();
  FSDPP_ASSIGN_OR_RETURN(
      grad, zeroed ? Tensor::Zeros(LocalShape(), dtype, data.device(),
                                   MemoryTag::kGrads)
                   : Tensor::Empty(LocalShape(), dtype, data.device(),
                                   MemoryTag::kGrads));
  return absl::OkStatus();
}

namespace {

// Calls fn(flat index in `layout`, element index in the box, run length) for
// every contiguous run of the box [offset, offset + size) of `layout`, in
// row-major order: the dims after the last one the box does not span whole
// join their predecessor's run, so a box of whole rows is one run.
void ForEachRun(const Shape& layout, const Shape& offset, const Shape& size,
                const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const int nd = static_cast<int>(layout.size());
  for (int64_t d : size) {
    if (d == 0) return;
  }
  int split = -1;  // The last dim the box does not span whole.
  for (int d = 0; d < nd; ++d) {
    if (size[d] != layout[d]) split = d;
  }
  if (split < 0) {
    fn(0, 0, NumElements(layout));
    return;
  }
  int64_t run = 1;
  for (int d = split; d < nd; ++d) run *= size[d];
  std::vector<int64_t> index(split, 0);  // Over the dims before `split`.
  int64_t local = 0;
  while (true) {
    int64_t flat = 0;
    for (int d = 0; d < nd; ++d) {
      flat = flat * layout[d] + offset[d] + (d < split ? index[d] : 0);
    }
    fn(flat, local, run);
    local += run;
    int d = split - 1;
    for (; d >= 0; --d) {
      if (++index[d] < size[d]) break;
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace

absl::Status Parameter::SetPiece(ParameterPiece p) {
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter ", ShapeToString(shape), ": piece ", ShapeToString(p.offset),
        " + ", ShapeToString(p.size), " of layout ", ShapeToString(p.layout),
        " stored as ", ShapeToString(p.local_shape), ": ", what));
  };
  // A piece held already may only be narrowed: the same layout, a box
  // inside the held one, both stored as their boxes' shapes (expert
  // parallelism cutting the expert dim of a tensor-parallel piece).
  const bool narrowing = has_piece();
  if (narrowing) {
    bool inside = p.layout == piece.layout && piece.local_shape == piece.size &&
                  p.local_shape == p.size &&
                  p.offset.size() == piece.offset.size() &&
                  p.size.size() == piece.size.size();
    for (size_t d = 0; inside && d < p.offset.size(); ++d) {
      inside = p.offset[d] >= piece.offset[d] && p.size[d] >= 0 &&
               p.offset[d] + p.size[d] <= piece.offset[d] + piece.size[d];
    }
    if (!inside) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parameter ", ShapeToString(shape), " already holds a piece (",
          ShapeToString(piece.offset), " + ", ShapeToString(piece.size), " of ",
          ShapeToString(piece.layout), "); the new piece ",
          ShapeToString(p.offset), " + ", ShapeToString(p.size), " of ",
          ShapeToString(p.layout),
          " is not a box inside it stored as its shape"));
    }
  }
  if (grad.defined()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "parameter ", ShapeToString(shape),
        " already has a gradient: cut it before the first backward"));
  }
  if (NumElements(p.layout) != NumElements(shape)) {
    return invalid("the layout does not have the parameter's elements");
  }
  if (p.offset.size() != p.layout.size() || p.size.size() != p.layout.size() ||
      p.size.empty()) {
    return invalid("offset and size need one entry per layout dim");
  }
  for (size_t d = 0; d < p.layout.size(); ++d) {
    if (p.offset[d] < 0 || p.size[d] < 0 ||
        p.offset[d] + p.size[d] > p.layout[d]) {
      return invalid(absl::StrCat("dim ", d, " is outside the layout"));
    }
  }
  if (NumElements(p.local_shape) != NumElements(p.size)) {
    return invalid("the local shape does not have the box's elements");
  }
  Tensor local;
  if (data.is_meta()) {
    FSDPP_ASSIGN_OR_RETURN(local,
                           Tensor::Empty(p.local_shape, dtype, Device::Meta(),
                                         MemoryTag::kParams));
  } else {
    FSDPP_ASSIGN_OR_RETURN(
        local,
        Tensor::Empty(p.local_shape, dtype, data.device(), MemoryTag::kParams));
    // The held values: the whole layout, or the held box.
    FSDPP_ASSIGN_OR_RETURN(Tensor held,
                           data.Reshape(narrowing ? piece.size : p.layout));
    Shape from = p.offset;
    for (size_t d = 0; narrowing && d < from.size(); ++d) {
      from[d] -= piece.offset[d];
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor box, local.Reshape(p.size));
    FSDPP_RETURN_IF_ERROR(
        CopyBox(held, from, &box, Shape(p.size.size(), 0), p.size));
  }
  data = std::move(local);
  piece = std::move(p);
  return absl::OkStatus();
}

absl::Status InitBox(const InitSpec& spec, uint64_t seed, uint64_t stream,
                     const Shape& layout, const Shape& offset,
                     const Shape& size, Tensor* out) {
  if (offset.size() != layout.size() || size.size() != layout.size() ||
      NumElements(size) != out->numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InitBox: box ", ShapeToString(offset), " + ", ShapeToString(size),
        " of ", ShapeToString(layout), " does not fit ", out->ToString()));
  }
  Tensor flat = out->Flatten();
  absl::Status status;
  ForEachRun(layout, offset, size,
             [&](int64_t global, int64_t local, int64_t length) {
               if (!status.ok()) return;
               absl::StatusOr<Tensor> run = flat.Narrow(local, length);
               status = run.ok() ? InitSlice(spec, seed, stream, global, &*run)
                                 : run.status();
             });
  return status;
}

absl::Status InitParameter(const Parameter& p, uint64_t seed, uint64_t stream,
                           Tensor* out) {
  if (!p.has_piece()) return InitSlice(p.init, seed, stream, 0, out);
  return InitBox(p.init, seed, stream, p.piece.layout, p.piece.offset,
                 p.piece.size, out);
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

bool MatchesNamePattern(std::string_view pattern, std::string_view name) {
  // Iterative glob matching: on a mismatch, retry from the last '*' with
  // one more character taken by it.
  size_t p = 0, n = 0, star = std::string_view::npos, taken = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      taken = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++taken;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

int64_t Module::NumParameters() const {
  int64_t n = 0;
  for (const auto& [name, p] : NamedParameters()) n += NumElements(p->shape);
  return n;
}

absl::Status Module::ToEmpty(Device device) {
  for (const auto& [name, p] : NamedParameters()) {
    if (!p->data.is_meta()) continue;
    FSDPP_ASSIGN_OR_RETURN(p->data, Tensor::Empty(p->LocalShape(), p->dtype,
                                                  device, MemoryTag::kParams));
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
    FSDPP_RETURN_IF_ERROR(
        Annotate(InitParameter(*p, seed, InitStreamId(name), &p->data),
                 absl::StrCat("initialising '", name, "'")));
  }
  return absl::OkStatus();
}

absl::Status Module::ZeroGrad(bool set_to_none) {
  for (const auto& [name, p] : NamedParameters()) {
    if (set_to_none) {
      p->grad = Tensor();
    } else if (p->grad.defined()) {
      FSDPP_RETURN_IF_ERROR(Zero(&p->grad));
    }
  }
  return absl::OkStatus();
}

absl::Status Module::RunHooks(std::vector<Hook>& hooks, Module& m) {
  for (Hook& hook : hooks) FSDPP_RETURN_IF_ERROR(hook(m));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Module::Forward(const Tensor& x) {
  FSDPP_RETURN_IF_ERROR(RunHooks(pre_forward_, *this));
  Tensor in = x;
  for (Transform& t : input_transforms_) {
    if (!t.forward) continue;
    absl::StatusOr<Tensor> mapped = t.forward(in);
    if (!mapped.ok()) {
      return Annotate(mapped.status(), absl::StrCat(kind_, " input layout"));
    }
    in = *std::move(mapped);
  }
  absl::StatusOr<Tensor> y = ForwardImpl(in);
  if (!y.ok()) return Annotate(y.status(), absl::StrCat(kind_, " forward"));
  for (Transform& t : output_transforms_) {
    if (!t.forward) continue;
    y = t.forward(*y);
    if (!y.ok()) {
      return Annotate(y.status(), absl::StrCat(kind_, " output layout"));
    }
  }
  FSDPP_RETURN_IF_ERROR(RunHooks(post_forward_, *this));
  return y;
}

absl::StatusOr<Tensor> Module::Backward(const Tensor& dy) {
  FSDPP_RETURN_IF_ERROR(RunHooks(pre_backward_, *this));
  Tensor d = dy;
  for (auto t = output_transforms_.rbegin(); t != output_transforms_.rend();
       ++t) {
    if (!t->backward) continue;
    absl::StatusOr<Tensor> mapped = t->backward(d);
    if (!mapped.ok()) {
      return Annotate(mapped.status(),
                      absl::StrCat(kind_, " output gradient layout"));
    }
    d = *std::move(mapped);
  }
  absl::StatusOr<Tensor> dx = BackwardImpl(d);
  if (!dx.ok()) return Annotate(dx.status(), absl::StrCat(kind_, " backward"));
  for (auto t = input_transforms_.rbegin(); t != input_transforms_.rend();
       ++t) {
    if (!t->backward || !dx->defined()) continue;
    dx = t->backward(*dx);
    if (!dx.ok()) {
      return Annotate(dx.status(),
                      absl::StrCat(kind_, " input gradient layout"));
    }
  }
  FSDPP_RETURN_IF_ERROR(RunHooks(post_backward_, *this));
  return dx;
}

void Module::ReleaseOwnSavedTensors() {
  for (Tensor* slot : SavedTensorSlots()) *slot = Tensor();
}

void Module::ReleaseSavedTensors() {
  ReleaseOwnSavedTensors();
  for (const auto& [name, child] : children_) child->ReleaseSavedTensors();
}

int64_t Module::SavedTensors::bytes() const {
  int64_t total = 0;
  for (const auto& [slot, tensor] : slots_) total += tensor.nbytes();
  return total;
}

Module::SavedTensors Module::StashSavedTensors() {
  SavedTensors saved;
  saved.owner_ = this;
  for (auto& [name, m] : NamedModules()) {
    for (Tensor* slot : m->SavedTensorSlots()) {
      if (!slot->defined()) continue;
      saved.slots_.emplace_back(slot, std::move(*slot));
      *slot = Tensor();
    }
  }
  return saved;
}

absl::Status Module::RestoreSavedTensors(SavedTensors saved) {
  if (saved.owner_ != this && !saved.slots_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(kind_,
                     "::RestoreSavedTensors: the tensors were stashed from "
                     "another module"));
  }
  for (auto& [name, m] : NamedModules()) {
    for (Tensor* slot : m->SavedTensorSlots()) {
      if (slot->defined()) {
        return absl::FailedPreconditionError(absl::StrCat(
            kind_, "::RestoreSavedTensors: ", m->kind(), " '", name,
            "' holds the tensors of a forward whose backward has not run; "
            "stash or release them first"));
      }
    }
  }
  for (auto& [slot, tensor] : saved.slots_) *slot = std::move(tensor);
  return absl::OkStatus();
}

}  // namespace fsdpp
