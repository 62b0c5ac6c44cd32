// The training step, written once: a step's micro-batches through a model
// that is already built and sharded -- forward, backward with the step's
// 1 / micro-batches (and a loss scale) folded into the loss gradient, the
// gradient reductions switched per micro-batch -- and the forward-only
// evaluation. The trainer, the planner's dry run, the parity harness and
// the benchmarks all run it (the first two through recipe::Training).
//
// Two implementations of one interface, chosen when the run is built:
//
//   PlainStep     the whole model on this rank (FSDP, HSDP, TP, DDP or
//                 none): micro-batch by micro-batch, each unit's gradient
//                 reduce-scattered by FSDP's hooks as its backward ends;
//                 HSDP's replicas all-reduce once, on the last micro-batch
//                 (FsdpUnit::SetRequiresAllReduce), and with
//                 GradientSync::every_micro_batch false nothing is reduced
//                 before the last (no_sync accumulation).
//   PipelineStep  this rank's pipeline stages: every micro-batch through
//                 the schedule (parallel::PipelineRunner) with FSDP's sync
//                 on each stage's last backward only, then the tied
//                 embedding's two copies summed across the first and last
//                 stage (models/pipeline.h); the loss, which lives on the
//                 last stage, summed over the pipeline group.
//
// The step zeroes the gradients first and returns this rank's loss (the
// mean over the micro-batches of its data-parallel replica); averaging it
// over the data-parallel ranks is the caller's (recipe::Training).
//
// A StepObserver watches the phases: the dry run records each phase's
// memory and runs only the micro-batches whose allocations differ (later
// ones repeat the last one's exactly), counting the rest.
#ifndef FSDPP_RECIPE_STEP_STEP_H_
#define FSDPP_RECIPE_STEP_STEP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/process_group.h"
#include "core/dtype.h"
#include "fsdp/fully_shard.h"
#include "fsdp/replicate.h"
#include "models/pipeline.h"
#include "models/transformer.h"
#include "nn/attention.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "parallel/pipeline_runner.h"
#include "parallel/pipeline_schedule.h"
#include "tensor/dtensor.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace recipe {

// One micro-batch: token ids and next-token targets, [rows, seq] integers
// (a target of -100 is left out of the loss: a prompt token of SFT data).
struct MicroBatch {
  Tensor ids;
  Tensor targets;
  // The targets that count in the loss over the whole step or evaluation:
  // every micro-batch of every data-parallel rank, whole rows (the same
  // value in each of the step's micro-batches). >= 0: the loss is the token
  // mean over that global batch -- each rank's micro-batch loss is its
  // targets' sum / (step_loss_tokens / (micro-batches x loss ranks)), so
  // that the caller's average over the ranks and micro-batches weighs every
  // counted target alike, however unevenly they fall (the gradient
  // accumulation pitfall of per-micro-batch means). -1: each micro-batch's
  // own mean, weighted equally.
  int64_t step_loss_tokens = -1;
  // One key per row naming its sample (nn/dropout.h: LoRA's dropout masks
  // follow it, so a sample drops the same elements in any micro-batch or
  // on any rank). Empty: the step makes keys from its own count of steps,
  // the micro-batch's index and the row (the same at another layout only
  // where every rank reads the same micro-batches).
  std::vector<uint64_t> row_keys = {};
};

// Micro-batch `index` (0-based) of the current step or evaluation, made
// when the step needs it.
using MicroBatchSource = std::function<absl::StatusOr<MicroBatch>(int64_t)>;

// Watches a step. Every method has a default that changes nothing.
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // How many of a step's `micro_batches` to run, 1 to micro_batches (each
  // still weighted 1 / micro_batches). PipelineStep always runs them all.
  virtual int64_t MicroBatchesToRun(int64_t micro_batches) {
    return micro_batches;
  }
  // Micro-batch `index` (0-based) of `run` begins / has ended (PlainStep).
  virtual void MicroBatchBegins(int64_t /*index*/, int64_t /*run*/) {}
  virtual void MicroBatchEnded(int64_t /*index*/, int64_t /*run*/) {}
  // A phase ended: "forward N" and "backward N" (1-based micro-batches),
  // "pipeline" (all of PipelineStep's micro-batches), "optimizer".
  virtual void PhaseEnded(absl::string_view /*phase*/) {}
};

// What a step's forward and backward did on this rank.
struct StepLoss {
  // The mean loss over the step's micro-batches (of this data-parallel
  // replica: every pipeline and tensor-parallel rank of it has the same);
  // NaN when it was left on the device (ForwardBackward's device_loss).
  double loss = 0;
  // PipelineStep: seconds computing and waiting for other stages, and the
  // most bytes held for backward at once (the stashed activations).
  double compute_seconds = 0;
  double wait_seconds = 0;
  int64_t peak_held_bytes = 0;
};

class Step {
 public:
  virtual ~Step() = default;

  // Zeroes the gradients, then runs `micro_batches` micro-batches from
  // `source`: forward, and backward scaled by loss_scale / micro_batches.
  // With `device_loss` (f32, one element, on the model's device; PlainStep
  // only) the mean loss is written there and not read back (StepLoss::loss
  // is NaN): a GPU step then waits for nothing. Errors name the phase
  // ("forward", "backward", "pipeline").
  virtual absl::StatusOr<StepLoss> ForwardBackward(
      int64_t micro_batches, double loss_scale, const MicroBatchSource& source,
      StepObserver* observer = nullptr, Tensor* device_loss = nullptr) = 0;

  // Forward only: the sum of the losses of `micro_batches` micro-batches
  // (on every rank of the replica). Leaves the units as the forwards left
  // them (the caller reshards).
  virtual absl::StatusOr<double> EvaluateSum(
      int64_t micro_batches, const MicroBatchSource& source) = 0;

  // The gradients the step accumulates into (every parameter this rank
  // trains) and how the gradient norm spans them (pipeline stages).
  virtual const std::vector<DTensor*>& grads() const = 0;
  virtual const PipelineNormOptions& norm_options() const = 0;

  // The ranks the caller averages the loss over and whose gradients are
  // averaged (data-parallel x context-parallel), for
  // MicroBatch::step_loss_tokens; 1 by default. InvalidArgument below 1.
  absl::Status set_loss_ranks(int64_t ranks);
  int64_t loss_ranks() const { return loss_ranks_; }

 protected:
  // Sets `loss`'s normalizer for a step or evaluation of `micro_batches`
  // whose first micro-batch is `first` (MicroBatch::step_loss_tokens; 0,
  // the count, for -1).
  absl::Status NormaliseLoss(nn::LossFunction* loss, const MicroBatch& first,
                             int64_t micro_batches) const;
  // InvalidArgument unless micro-batch `index` carries `first`'s
  // step_loss_tokens.
  static absl::Status CheckLossTokens(const MicroBatch& first,
                                      const MicroBatch& batch, int64_t index);
  // The dropout keys of micro-batch `index` of this step (`rows` rows): its
  // row_keys, or the step's own (see MicroBatch::row_keys). InvalidArgument
  // for row_keys of another length.
  absl::StatusOr<std::vector<uint64_t>> RowKeys(const MicroBatch& batch,
                                                int64_t index,
                                                int64_t rows) const;
  // Counts a ForwardBackward (the steps' own dropout keys).
  void CountStep() { ++steps_; }

 private:
  int64_t loss_ranks_ = 1;
  int64_t steps_ = 0;
};

struct OptimizerStepOptions {
  double lr = 0;
  // > 0: clip the gradients' global norm to this (inside AdamW's pass).
  double grad_clip = 0;
  // f16: unscale the gradients and skip the step when they overflowed.
  LossScaler* scaler = nullptr;
  // Both set (and no scaler): the step decided on the device, nothing read
  // back. The squared gradient norm is written to *device_norm_sq
  // (GradNormSquaredOnDevice) and AdamW reads it and *device_loss (the
  // step's device_loss) itself: it skips the update when either is not
  // finite, and clips (AdamW::StepGuard).
  const Tensor* device_loss = nullptr;
  Tensor* device_norm_sq = nullptr;
};

struct OptimizerStepResult {
  // Before clipping; NaN when the step was skipped for an overflow.
  double grad_norm = 0;
  // The loss scaler found an overflow: nothing was updated (the scale was).
  bool skipped = false;
  // AdamW updated the parameters (false when skipped, or when the norm is
  // not finite: the caller stops).
  bool applied = false;
  // Decided on the device (the options' device tensors): grad_norm is NaN
  // and `applied` only says that AdamW ran; whether it updated anything
  // follows from the device values, read later.
  bool on_device = false;
};

// The optimizer's part of a step, after `step`'s ForwardBackward: f16's
// unscale and overflow check (with a scaler), the gradient norm over every
// axis the gradients are sharded on and the pipeline, then the LR and the
// AdamW step with the clip folded into its pass (the same update as
// scaling the gradients first). Nothing is updated when the scaler found an
// overflow or the norm is not finite (the result says which). The
// observer's "optimizer" phase ends here.
absl::StatusOr<OptimizerStepResult> OptimizerStep(
    Step& step, AdamW& adamw, const OptimizerStepOptions& options,
    StepObserver* observer = nullptr);

// Which gradient reductions PlainStep switches per micro-batch.
struct GradientSync {
  // FSDP: HSDP's replica all-reduce only on the last micro-batch.
  std::vector<fsdp::FsdpUnit*> units;
  // DDP (fsdp::Replicate).
  fsdp::ReplicatedModule* replicated = nullptr;
  // false: no reduction before the last micro-batch (unsharded gradients
  // accumulate; FSDP2's set_requires_gradient_sync(False)).
  bool every_micro_batch = true;
  // false: FSDP units keep their gathered parameters from the step's first
  // forward to its last backward (ZeRO-1 with every_micro_batch false: one
  // all-gather per unit and step).
  bool reshard_after_backward = true;
};

class PlainStep final : public Step {
 public:
  // `model` and what `grads` point to outlive the step.
  PlainStep(models::Transformer* model, std::vector<DTensor*> grads,
            GradientSync sync = {});

  absl::StatusOr<StepLoss> ForwardBackward(
      int64_t micro_batches, double loss_scale, const MicroBatchSource& source,
      StepObserver* observer = nullptr, Tensor* device_loss = nullptr) override;
  absl::StatusOr<double> EvaluateSum(int64_t micro_batches,
                                     const MicroBatchSource& source) override;
  const std::vector<DTensor*>& grads() const override { return grads_; }
  const PipelineNormOptions& norm_options() const override { return norm_; }

 private:
  void SetSync(bool last);

  models::Transformer* model_;
  std::vector<DTensor*> grads_;
  GradientSync sync_;
  // grads_ that are not sync_.units' sharded gradients: zeroed at the start
  // of a step (the units' are zeroed lazily by their first reduction).
  std::vector<DTensor*> eager_grads_;
  PipelineNormOptions norm_;  // nothing across stages
};

// A parameter a pipeline stage trains: its name in the model and its
// gradient (the FSDP master's, a tensor-parallel piece's or a whole one).
struct StageGrad {
  std::string name;
  DTensor* grad = nullptr;
};

// One stage of this pipeline rank, as built: its model part, its FSDP
// units (none without FSDP) and the gradients of its parameters.
struct PipelineStageTraining {
  models::PipelineStagePart part;
  std::vector<fsdp::FsdpUnit*> units;
  std::vector<StageGrad> grads;
};

struct PipelineStepOptions {
  // The hidden states between stages: [rows, seq / seq_split, dim] in
  // `hidden_dtype` (seq_split: tp with sequence parallelism, else 1).
  int seq_split = 1;
  DType hidden_dtype = DType::kF32;
  // Bound on every transfer between stages and the shared-gradient sum.
  absl::Duration timeout = absl::Minutes(5);
  // The pipeline ranks' group for host values (the loss summed from the
  // last stage) when the pipeline group takes device buffers only (NCCL);
  // null: the pipeline group.
  ProcessGroup* host_pipeline = nullptr;
  // Context parallelism's split of the parts (not owned; null: off): the
  // last stage's targets are this rank's columns, the hidden states its
  // rows.
  nn::ContextParallel* context_parallel = nullptr;
  // The gradient norm's stages reduced over their own meshes before they
  // are added (PipelineNormOptions::stage_reduced): expert parallelism, whose
  // experts' grads lie on their own mesh. The same on every pipeline rank.
  bool norm_stage_reduced = false;
};

class PipelineStep final : public Step {
 public:
  // `stages` in stage order (this rank's, as the schedule gives them), kept
  // by the step. The runner is made at the first micro-batch
  // (the hidden shape follows its rows and sequence). The norm counts the
  // tied weight's copy on the last stage out, and the copies' gradients
  // are summed after each step.
  static absl::StatusOr<std::unique_ptr<PipelineStep>> Create(
      ProcessGroup* pipeline, parallel::PipelineSchedule schedule,
      std::vector<PipelineStageTraining> stages, PipelineStepOptions options);

  absl::StatusOr<StepLoss> ForwardBackward(
      int64_t micro_batches, double loss_scale, const MicroBatchSource& source,
      StepObserver* observer = nullptr, Tensor* device_loss = nullptr) override;
  absl::StatusOr<double> EvaluateSum(int64_t micro_batches,
                                     const MicroBatchSource& source) override;
  const std::vector<DTensor*>& grads() const override { return grads_; }
  const PipelineNormOptions& norm_options() const override { return norm_; }

  const parallel::PipelineSchedule& schedule() const { return schedule_; }
  // This rank's stages' model parts, in stage order.
  const std::vector<models::PipelineStagePart>& parts() const { return parts_; }

 private:
  PipelineStep(ProcessGroup* pipeline, parallel::PipelineSchedule schedule,
               std::vector<PipelineStageTraining> stages,
               PipelineStepOptions options);
  ProcessGroup* HostPipeline() const {
    return options_.host_pipeline != nullptr ? options_.host_pipeline
                                             : pipeline_;
  }
  // The micro-batches, and the runner made for their shape.
  absl::Status Gather(int64_t micro_batches, const MicroBatchSource& source,
                      std::vector<Tensor>* ids, std::vector<Tensor>* targets);

  ProcessGroup* pipeline_;
  // Each micro-batch's dropout keys (Gather), and whether the runner is in
  // a training step (its forwards then drop).
  std::vector<std::vector<uint64_t>> row_keys_;
  bool training_ = false;
  parallel::PipelineSchedule schedule_;
  std::vector<models::PipelineStagePart> parts_;
  std::map<int, std::vector<fsdp::FsdpUnit*>> units_;  // by stage
  std::vector<fsdp::FsdpUnit*> all_units_;
  PipelineStepOptions options_;
  std::vector<DTensor*> grads_;
  PipelineNormOptions norm_;
  Tensor* tied_first_ = nullptr;
  Tensor* tied_last_ = nullptr;
  std::unique_ptr<parallel::PipelineRunner> runner_;
  Shape hidden_;  // the runner's
  // The micro-batches' ids of the step or evaluation in progress: the
  // parts without the embeddings take them before each forward
  // (Transformer::SetBatch: document masks, context-parallel positions).
  std::vector<Tensor> batch_ids_;
};

}  // namespace recipe
}  // namespace fsdpp

#endif  // FSDPP_RECIPE_STEP_STEP_H_
