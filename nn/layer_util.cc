// Shared layer helpers; see layer_util.h.
#include "nn/layer_util.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {

absl::StatusOr<Tensor> EmptyActivation(Shape shape, DType dtype,
                                       Device device) {
  return Tensor::Empty(std::move(shape), dtype, device,
                       MemoryTag::kActivations);
}

absl::StatusOr<Tensor> EmptyTemporary(Shape shape, DType dtype, Device device) {
  return Tensor::Empty(std::move(shape), dtype, device, MemoryTag::kOther);
}

absl::StatusOr<Tensor> CastTo(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  FSDPP_ASSIGN_OR_RETURN(Tensor out,
                         EmptyTemporary(t.shape(), dtype, t.device()));
  FSDPP_RETURN_IF_ERROR(Copy(t, &out));
  return out;
}

absl::StatusOr<Tensor> AsRows(const Tensor& t, int64_t cols,
                              const std::string& what) {
  if (!t.defined() || t.ndim() == 0 || t.dim(-1) != cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be [.., ", cols, "], got ", t.ToString()));
  }
  return t.Reshape({t.numel() / (cols == 0 ? 1 : cols), cols});
}

absl::Status NoSavedForward(const std::string& kind) {
  return absl::FailedPreconditionError(absl::StrCat(
      kind,
      ": Backward without a Forward (saved tensors are released by Backward "
      "and by ReleaseSavedTensors)"));
}

absl::StatusOr<NormBackwardStart> StartNormBackward(const std::string& kind,
                                                    const Tensor& saved_x,
                                                    const Tensor& dy,
                                                    const Tensor& weight) {
  if (!saved_x.defined()) return NoSavedForward(kind);
  NormBackwardStart start;
  start.x = saved_x;
  const Tensor& x = start.x;
  if (!dy.defined() || dy.shape() != x.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dy must be ", ShapeToString(x.shape()), ", got ", dy.ToString()));
  }
  FSDPP_ASSIGN_OR_RETURN(start.dy, CastTo(dy, x.dtype()));
  FSDPP_ASSIGN_OR_RETURN(start.w, CastTo(weight, x.dtype()));
  FSDPP_ASSIGN_OR_RETURN(start.dx,
                         EmptyTemporary(x.shape(), x.dtype(), x.device()));
  return start;
}

absl::StatusOr<GradSink> GradSink::For(Parameter* p, DType compute_dtype,
                                       bool accepts_f32) {
  return Make(p, compute_dtype, accepts_f32, false);
}

absl::StatusOr<GradSink> GradSink::ForWrite(Parameter* p, DType compute_dtype,
                                            bool accepts_f32) {
  return Make(p, compute_dtype, accepts_f32, true);
}

absl::StatusOr<GradSink> GradSink::Make(Parameter* p, DType compute_dtype,
                                        bool accepts_f32, bool write) {
  GradSink sink;
  sink.parameter_ = p;
  if (p->requires_grad) {
    const bool had_grad = p->grad.defined();
    const DType g = had_grad ? p->grad.dtype() : p->dtype;
    if (g == compute_dtype || (accepts_f32 && g == DType::kF32)) {
      const bool fresh = write && !had_grad;
      FSDPP_RETURN_IF_ERROR(p->EnsureGrad(!fresh));
      sink.direct_ = true;
      sink.accumulate_ = !fresh;
      sink.fresh_ = fresh;
      return sink;
    }
    FSDPP_RETURN_IF_ERROR(p->EnsureGrad());
  }
  const Device device = p->data.device();
  FSDPP_ASSIGN_OR_RETURN(sink.temporary_,
                         write ? Tensor::Empty(p->LocalShape(), compute_dtype,
                                               device, MemoryTag::kOther)
                               : Tensor::Zeros(p->LocalShape(), compute_dtype,
                                               device, MemoryTag::kOther));
  sink.accumulate_ = !write;
  return sink;
}

GradSink::GradSink(GradSink&& other) noexcept
    : parameter_(std::exchange(other.parameter_, nullptr)),
      direct_(other.direct_),
      accumulate_(other.accumulate_),
      fresh_(std::exchange(other.fresh_, false)),
      temporary_(std::move(other.temporary_)) {}

GradSink& GradSink::operator=(GradSink&& other) noexcept {
  if (this != &other) {
    if (fresh_) parameter_->grad = Tensor();
    parameter_ = std::exchange(other.parameter_, nullptr);
    direct_ = other.direct_;
    accumulate_ = other.accumulate_;
    fresh_ = std::exchange(other.fresh_, false);
    temporary_ = std::move(other.temporary_);
  }
  return *this;
}

GradSink::~GradSink() {
  if (fresh_) parameter_->grad = Tensor();
}

absl::Status GradSink::Commit() {
  fresh_ = false;
  if (direct_ || !parameter_->requires_grad) return absl::OkStatus();
  FSDPP_ASSIGN_OR_RETURN(Tensor converted,
                         CastTo(temporary_, parameter_->grad.dtype()));
  FSDPP_ASSIGN_OR_RETURN(Tensor shaped,
                         converted.Reshape(parameter_->grad.shape()));
  FSDPP_RETURN_IF_ERROR(Axpy(1.0f, shaped, &parameter_->grad));
  temporary_ = Tensor();
  return absl::OkStatus();
}

namespace {
thread_local SelectiveRecompute* active_recompute = nullptr;
}  // namespace

SelectiveRecompute* SelectiveRecompute::Active() { return active_recompute; }

void SelectiveRecompute::Record(const Module* module,
                                std::vector<Tensor> outputs) {
  calls_.push_back({module, std::move(outputs)});
}

absl::StatusOr<std::vector<Tensor>> SelectiveRecompute::Replay(
    const Module* module) {
  for (Call& call : calls_) {
    if (call.module != module || call.replayed) continue;
    call.replayed = true;
    bool recorded = !call.outputs.empty();
    for (const Tensor& t : call.outputs) recorded = recorded && t.defined();
    if (!recorded) break;  // released since
    std::vector<Tensor> outputs = std::move(call.outputs);
    call.outputs.clear();
    return outputs;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "selective activation checkpointing: ", module->kind(),
      " has no recorded output to reuse in the recomputation (the "
      "recomputation must run the first forward's ops in its order)"));
}

std::vector<Tensor*> SelectiveRecompute::Slots() {
  std::vector<Tensor*> slots;
  for (Call& call : calls_) {
    for (Tensor& t : call.outputs) slots.push_back(&t);
  }
  return slots;
}

void SelectiveRecompute::Clear() { calls_.clear(); }

SelectiveRecompute::Scope::Scope(SelectiveRecompute* store, bool replay)
    : previous_(active_recompute) {
  store->replaying_ = replay;
  active_recompute = store;
}

SelectiveRecompute::Scope::~Scope() { active_recompute = previous_; }

}  // namespace nn
}  // namespace fsdpp
