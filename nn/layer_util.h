// Helpers shared by the layers: tagged activation buffers, dtype casts, and
// gradient accumulation into a Parameter whose grad dtype may differ from the
// dtype the layer computes in.
//
// Layers compute in the dtype of their input (activations follow the input)
// while a parameter keeps the dtype it was created with, and the ops want
// matching dtypes (a Matmul accumulator may also be f32). GradSink hides the
// difference: it hands the op p->grad itself when the op can accumulate into
// it directly, or a zeroed temporary in the compute dtype that Commit adds
// into p->grad (ForWrite: an op that can write instead of accumulating
// skips the zeros where nothing is accumulated yet). Memory tags: forward
// outputs and tensors saved for backward are kActivations (what activation
// checkpointing frees); transient buffers (casts, gradients w.r.t. activations)
// are kOther.
#ifndef FSDPP_NN_LAYER_UTIL_H_
#define FSDPP_NN_LAYER_UTIL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// Uninitialised forward output or saved tensor on `device`, tagged
// kActivations.
absl::StatusOr<Tensor> EmptyActivation(Shape shape, DType dtype, Device device);

// Uninitialised transient buffer on `device`, tagged kOther.
absl::StatusOr<Tensor> EmptyTemporary(Shape shape, DType dtype, Device device);

// `t` itself when it already has `dtype`, else a converted copy (kOther).
absl::StatusOr<Tensor> CastTo(const Tensor& t, DType dtype);

// A [rows, last dim] view of `t`, which must have at least one dim and a
// last dim of `cols` (InvalidArgument naming `what` and the shape otherwise).
absl::StatusOr<Tensor> AsRows(const Tensor& t, int64_t cols,
                              const std::string& what);

// FailedPrecondition for a Backward with nothing saved by a Forward.
absl::Status NoSavedForward(const std::string& kind);

// What the backward of a normalisation layer (LayerNorm, RmsNorm) starts
// from: the input its forward saved, dy and the weight cast to the input's
// dtype, and an uninitialised dx (kOther) like the input.
struct NormBackwardStart {
  Tensor x;
  Tensor dy;
  Tensor w;
  Tensor dx;
};

// The prologue shared by normalisation layers' backward: `saved_x` is the
// input saved by the forward (NoSavedForward(kind) if undefined), `dy` must
// have its shape (InvalidArgument otherwise), `weight` the layer's weight.
absl::StatusOr<NormBackwardStart> StartNormBackward(const std::string& kind,
                                                    const Tensor& saved_x,
                                                    const Tensor& dy,
                                                    const Tensor& weight);

// Where a layer's op accumulates a parameter's gradient contribution.
class GradSink {
 public:
  // A sink for `p` (not null) fed by an op computing in `compute_dtype`; with
  // `accepts_f32` the op can also accumulate into an f32 tensor. Creates
  // p->grad (zeros) if needed. When p does not require a gradient the target
  // is a scratch tensor and Commit does nothing.
  static absl::StatusOr<GradSink> For(Parameter* p, DType compute_dtype,
                                      bool accepts_f32);
  // The same for an op that can write its result in place of adding it (a
  // matmul's beta = 0): where p has no gradient yet, or the target is a
  // temporary, the target is left uninitialised and accumulate() is false;
  // the op then writes every element of it before Commit. Saves zeroing the
  // gradient and reading the zeros back (each step's first backward under
  // FSDP, whose gradients are freed once reduced). An uninitialised p->grad
  // the sink made is dropped again (p->grad undefined) unless committed, so
  // a failed op leaves no garbage to accumulate into.
  static absl::StatusOr<GradSink> ForWrite(Parameter* p, DType compute_dtype,
                                           bool accepts_f32);

  GradSink(GradSink&& other) noexcept;
  GradSink& operator=(GradSink&& other) noexcept;
  GradSink(const GradSink&) = delete;
  GradSink& operator=(const GradSink&) = delete;
  ~GradSink();

  // The tensor the op accumulates into (p->grad or a temporary: zeroed, or
  // uninitialised when !accumulate()).
  Tensor* target() { return direct_ ? &parameter_->grad : &temporary_; }
  // Whether the op adds into target() (else it writes it whole).
  bool accumulate() const { return accumulate_; }
  // Adds the temporary into p->grad (converting its dtype); no-op otherwise.
  absl::Status Commit();

 private:
  GradSink() = default;
  static absl::StatusOr<GradSink> Make(Parameter* p, DType compute_dtype,
                                       bool accepts_f32, bool write);

  Parameter* parameter_ = nullptr;
  bool direct_ = false;
  bool accumulate_ = true;
  // p->grad was made uninitialised by this sink and is not committed yet.
  bool fresh_ = false;
  Tensor temporary_;
};

// Selective activation checkpointing's store (ActivationCheckpoint in
// selective mode): while one is installed on this thread, the expensive ops
// of a checkpointed subtree (Linear's matmul, the fused attention core)
// record their outputs in the first forward and, in the recomputation,
// take them back instead of computing them again; the cheap ops between
// them (norms, activations, head copies, RoPE) are recomputed. Each module's
// outputs come back in the order it recorded them.
class SelectiveRecompute {
 public:
  // The store installed on this thread, or null.
  static SelectiveRecompute* Active();

  // Whether the installed scope recomputes (else it records).
  bool replaying() const { return replaying_; }
  // Records the outputs of one call of `module`'s op.
  void Record(const Module* module, std::vector<Tensor> outputs);
  // The outputs `module` recorded for its next call; FailedPrecondition if
  // it recorded none (the recomputation took another path, or the store
  // was released).
  absl::StatusOr<std::vector<Tensor>> Replay(const Module* module);
  // Every recorded tensor (for ActivationCheckpoint's saved-tensor slots).
  std::vector<Tensor*> Slots();
  void Clear();

  // Installs `store` on this thread for the scope, recording or replaying.
  class Scope {
   public:
    Scope(SelectiveRecompute* store, bool replay);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    SelectiveRecompute* previous_;
  };

 private:
  struct Call {
    const Module* module;
    std::vector<Tensor> outputs;
    bool replayed = false;
  };
  bool replaying_ = false;
  std::vector<Call> calls_;
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_LAYER_UTIL_H_
