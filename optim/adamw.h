// AdamW over sharded fp32 master parameters (FSDP2's optimizer layout).
//
// The optimizer state (exp_avg m, exp_avg_sq v) of each parameter is a
// DTensor with exactly the parameter's layout (mesh, placements, global and
// local shape), so Step() touches only this rank's shards and never
// communicates: AdamW is elementwise, and any sharding of an elementwise
// update gives the same numbers as the unsharded one, bit for bit. State
// memory is accounted under MemoryTag::kOptimizerState.
//
// Arithmetic: torch.optim.AdamW's single-tensor path in torch's operation
// order, decoupled weight decay FIRST (p *= 1 - lr * wd), then the Adam
// update with bias correction; the per-element code is written once in
// optim/kernels/adamw.h and run by an OpenMP loop on the CPU and by a CUDA
// kernel (optim/adamw_cuda.cu) for parameters on a GPU. Each parameter is
// updated in one fused pass that also refreshes its optional low-precision
// compute copy (the fp32-master + bf16-compute mixed-precision pattern).
#ifndef FSDPP_OPTIM_ADAMW_H_
#define FSDPP_OPTIM_ADAMW_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor/dtensor.h"
#include "tensor/tensor.h"

namespace fsdpp {

// AdamW hyper-parameters (torch.optim.AdamW's defaults).
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // Decoupled weight decay coefficient.
  double weight_decay = 1e-2;
  // Whether a parameter gets weight decay, from its name and value; unset
  // means every parameter does. AdamWParam::weight_decay overrides it.
  std::function<bool(const std::string& name, const DTensor& param)>
      decay_filter;
};

// A decay_filter: decay parameters with two or more dims (linear weights,
// embeddings), not vectors (biases, norm weights) — the nanoGPT / llm.c rule.
bool DecayMatricesOnly(const std::string& name, const DTensor& param);

// One parameter the optimizer updates. The DTensors are not owned and must
// outlive the optimizer; `grad` is read at every Step() and must then have
// the param's layout (mesh, placements, shapes, device) and dtype f32.
struct AdamWParam {
  // weight_decay unset: AdamWOptions::decay_filter decides.
  AdamWParam(std::string name, DTensor* param, DTensor* grad,
             std::optional<bool> weight_decay = std::nullopt)
      : name(std::move(name)),
        param(param),
        grad(grad),
        weight_decay(weight_decay) {}

  std::string name;  // Unique; names the state ("<name>.exp_avg").
  DTensor* param;    // fp32 master (sharded), updated in place.
  DTensor* grad;
  // Explicit group membership: overrides AdamWOptions::decay_filter.
  std::optional<bool> weight_decay;
};

// An optimizer's state in the DCP-style flat form: sharded state tensors and
// scalars under stable names.
struct OptimizerStateDict {
  // "<param>.exp_avg", "<param>.exp_avg_sq".
  std::map<std::string, DTensor> tensors;
  // "step".
  std::map<std::string, int64_t> scalars;
};

// AdamW over a fixed list of params. Move-only: a copy would share the
// state tensors' storage.
class AdamW {
 public:
  // Validates the options (lr, eps, weight_decay >= 0 and finite, betas in
  // [0, 1)) and params (non-null, unique non-empty names, f32 params without
  // Partial placements). Allocates nothing: state comes with Init() or the
  // first Step().
  static absl::StatusOr<AdamW> Create(std::vector<AdamWParam> params,
                                      AdamWOptions options = {});

  AdamW(AdamW&&) = default;
  AdamW& operator=(AdamW&&) = default;
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // Allocates m and v (zeros, kOptimizerState) for every param now rather
  // than at the first Step(). Idempotent.
  absl::Status Init();

  // One AdamW step of every param from its grad, on local shards only (no
  // communication): checks every grad first (nothing changes on an argument
  // error), then advances the step counter and updates params, state and
  // compute copies. Kernels on a GPU are enqueued on the legacy default
  // stream and not waited for. Each gradient element is multiplied by
  // `grad_scale` (finite, > 0) as it is read: gradient clipping's
  // coefficient (ClipCoefficient in optim/clip.h) without a separate pass
  // over the gradients; the grads themselves are left as they are.
  absl::Status Step(float grad_scale = 1.0f);

  // A step whose gradient scale and skip are decided where the step's
  // values are, so that a GPU step needs no host read: `loss` (this rank's
  // loss of the step) and `norm_sq` (the squared global gradient norm,
  // optim/clip.h's GradNormSquaredOnDevice), f32 tensors of one element on
  // the params' device, are read by the update itself. When either is not
  // finite nothing is updated (params, state and compute copies keep their
  // bits; the step counter still advances, and the caller, reading the
  // values later, stops the run); otherwise each gradient is scaled by
  // ClipCoefficient(sqrt(norm_sq), max_norm) for max_norm > 0, else 1: the
  // update Step(ClipCoefficient(...)) makes, bit for bit.
  struct StepGuard {
    const Tensor* loss = nullptr;
    const Tensor* norm_sq = nullptr;
    double max_norm = 0;  // 0: no clipping
  };
  absl::Status Step(const StepGuard& guard);

  // Makes `copy` (not owned; a view of this rank's local shard in any float
  // dtype, e.g. bf16, with the local shard's element count, on its device)
  // the compute copy of param `name`: written now from the master and then
  // in every Step(). nullptr detaches it.
  absl::Status SetComputeCopy(const std::string& name, Tensor* copy);

  // The state: "<param>.exp_avg" and "<param>.exp_avg_sq" DTensors (sharing
  // storage with the optimizer's state, so loading into them in place works)
  // and the scalar "step". Initialises the state if needed.
  absl::StatusOr<OptimizerStateDict> StateDict();

  // Replaces the state with `state`, which must hold exactly the names
  // StateDict() gives. Tensors must have the params' global shapes, a float
  // dtype and the params' mesh; other placements are redistributed (a
  // collective: every rank must call this). All checks run before anything
  // is changed.
  absl::Status LoadStateDict(const OptimizerStateDict& state);

  // Sets the learning rate of the following steps (e.g. from LrSchedule);
  // InvalidArgument if negative or not finite.
  absl::Status SetLr(double lr);
  // The current learning rate.
  double lr() const { return options_.lr; }
  // The hyper-parameters (lr as last set).
  const AdamWOptions& options() const { return options_; }
  // Steps taken (the bias-correction t of the last step).
  int64_t step() const { return step_; }
  // Sets the step counter, for state that was loaded in place into
  // StateDict()'s tensors (a checkpoint) together with its saved step.
  // InvalidArgument if negative.
  absl::Status SetStep(int64_t step);
  // True once the state is allocated.
  bool initialized() const { return initialized_; }
  // Whether param `name` gets weight decay; NotFound for an unknown name.
  absl::StatusOr<bool> DecaysWeight(const std::string& name) const;

 private:
  struct Entry {
    std::string name;
    DTensor* param = nullptr;
    DTensor* grad = nullptr;
    bool decay = true;
    DTensor exp_avg;
    DTensor exp_avg_sq;
    Tensor* copy = nullptr;
  };

  explicit AdamW(AdamWOptions options) : options_(std::move(options)) {}
  Entry* Find(const std::string& name);
  // Checks the param, grad, state and copy of `e` before a step.
  absl::Status CheckForStep(const Entry& e) const;
  // The fused update of one entry with `decay`-adjusted scalars; a GPU
  // update reads its scale from `guard`'s tensors when they are given.
  absl::Status UpdateEntry(const Entry& e, float grad_scale,
                           const StepGuard* guard = nullptr) const;
  // Step's checks and counter; then `update` per entry.
  absl::Status StepWith(
      const std::function<absl::Status(const Entry&)>& update);

  AdamWOptions options_;
  std::vector<Entry> entries_;
  int64_t step_ = 0;
  bool initialized_ = false;
};

}  // namespace fsdpp

#endif  // FSDPP_OPTIM_ADAMW_H_
