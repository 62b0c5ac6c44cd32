// The build and the step of a run, written once: what one rank trains for a
// Layout (recipe/layout.h), and its optimizer step. The trainer runs it for
// real; the planner's dry run (plan/dry_run.h) runs the same code on meta
// tensors over simulated process groups, so the plan is what the run does.
//
// Build, on a mesh whose axes are layout.MeshAxes():
//   * without pipeline parallelism, the whole model on the meta device, the
//     family's tensor-parallel plan on the tp axis (recipe/families.h), the
//     family's FSDP plan (each block a unit, then the root; HSDP on the
//     replicate axis, hpZ, mixed precision, offload), sharded initialisation
//     from the seed (the same weights at any layout), a PlainStep;
//   * with it, this pipeline rank's stages (models::BuildPipelineParts, the
//     blocks cut by the layout) each with both plans on the stage mesh (the
//     mesh without pp), a PipelineStep over the schedule;
//   * AdamW on the sharded fp32 masters, weight decay on the parameters with
//     two or more dims (the nanoGPT rule); the parameters layout.freeze
//     names are frozen before the plans: no gradient, reduce-scatter,
//     clipping share or optimizer state.
//
// The step: ForwardBackward (the micro-batches, then the loss averaged over
// the world), OptimizerStep (f16's unscale and overflow check, the gradient
// norm over every axis the gradients are sharded on and the pipeline, the
// clip folded into AdamW's pass, AdamW), Evaluate (forward only). A
// StepObserver sees the phases.
#ifndef FSDPP_RECIPE_TRAINING_H_
#define FSDPP_RECIPE_TRAINING_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/process_group.h"
#include "core/device.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/pipeline.h"
#include "models/transformer.h"
#include "optim/adamw.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "recipe/layout.h"
#include "recipe/step/step.h"

namespace fsdpp {
namespace recipe {

struct BuildOptions {
  // The sharded initialisation's seed.
  uint64_t seed = 0;
  // Where offloaded state lives (the CPU; a dry run's separate host).
  Device host = Device::Cpu();
  // Bound of the tensor-parallel and pipeline collectives' waits.
  absl::Duration timeout = absl::Minutes(5);
  // AdamW's hyper-parameters (the decay rule above sets each parameter's
  // group; decay_filter is not used).
  AdamWOptions adamw;
  // The mesh (the same axes) whose groups carry the step's host values (the
  // loss, the pipeline's report) when `mesh`'s groups take device buffers
  // only (NCCL: a Gloo mesh over the same store, as PyTorch keeps a Gloo
  // group for its objects); null: `mesh` itself.
  DeviceMesh* host_mesh = nullptr;
  // Keep each step's loss and gradient norm on the device, read only when
  // asked (Training::ReadStepValues), so that a GPU step never waits for the
  // GPU (torchtitan reads its loss only at logged steps). Honoured where
  // the step can (Training::values_on_device); elsewhere ignored.
  bool step_values_on_device = false;
};

class Training {
 public:
  // Builds this rank's share of `model` laid out as `layout` on `mesh`.
  // InvalidArgument for a layout that does not validate against the model
  // or a mesh of other axes; the plans' errors annotated with the stage.
  static absl::StatusOr<std::unique_ptr<Training>> Build(
      const models::TransformerConfig& model, const Layout& layout,
      DeviceMesh* mesh, const BuildOptions& options);

  // The step's forward and backward over its layout.grad_accumulation
  // micro-batches (loss_scale folded into the backward); the loss averaged
  // over the world (NaN with values_on_device: ReadStepValues has it).
  absl::StatusOr<StepLoss> ForwardBackward(const MicroBatchSource& source,
                                           double loss_scale = 1.0,
                                           StepObserver* observer = nullptr);
  // The optimizer's part of the step, after ForwardBackward
  // (recipe::OptimizerStep on this rank's step and AdamW). With
  // values_on_device the norm and the skip are decided on the device (the
  // result's on_device; options.device_* are set here).
  absl::StatusOr<OptimizerStepResult> OptimizerStep(
      const OptimizerStepOptions& options, StepObserver* observer = nullptr);

  // Whether the steps keep their loss and gradient norm on the device:
  // BuildOptions::step_values_on_device, without pipeline parallelism (the
  // loss is summed over the stages on the host), f16 (the loss scaler reads
  // its overflow check) or offload (AdamW runs on the host).
  bool values_on_device() const { return values_on_device_; }
  // Steps run since the last ReadStepValues. ForwardBackward refuses to run
  // more than kMaxPendingSteps without one.
  static constexpr int64_t kMaxPendingSteps = 64;
  int64_t pending_steps() const { return pending_steps_; }
  // The values of the pending steps, oldest first, in one copy from the
  // device (one host wait on a GPU) and one host all-reduce averaging the
  // losses over the world: every rank calls it at the same step. A step
  // whose loss (on any rank) or gradient norm is not finite was not
  // applied: AdamW skipped it on the device. Empty when none is pending.
  struct StepValues {
    double loss = 0;
    double grad_norm = 0;
    bool applied() const {
      return std::isfinite(loss) && std::isfinite(grad_norm);
    }
  };
  absl::StatusOr<std::vector<StepValues>> ReadStepValues();
  // The mean loss of `micro_batches` forward-only micro-batches, averaged
  // over the world; what the forwards left gathered is freed after.
  absl::StatusOr<double> Evaluate(int64_t micro_batches,
                                  const MicroBatchSource& source);

  // Header lines for the run's log (the pipeline's schedule, context
  // parallelism's split; none without either).
  std::vector<std::string> Describe() const;
  // Over the steps a caller measured: this rank's seconds computing and
  // waiting in the step and the most bytes it held for backward; the
  // per-rank table of the whole world (a collective over it; empty without
  // pipeline parallelism).
  struct Totals {
    double compute_seconds = 0;
    double wait_seconds = 0;
    int64_t peak_held_bytes = 0;
  };
  absl::StatusOr<std::string> ReportTable(const Totals& totals) const;
  // The schedule's idle fraction with a backward twice a forward (0
  // without pipeline parallelism).
  double schedule_bubble() const { return schedule_bubble_; }

  const models::TransformerConfig& config() const { return config_; }
  const Layout& layout() const { return layout_; }
  DeviceMesh* mesh() const { return mesh_; }
  // The host mesh's flat group (the loss: host values).
  ProcessGroup* world() const { return world_; }
  // With MoE layers: the host group of this rank's data-parallel ranks (same
  // stage and tp coordinate), which the expert loads are summed over; null
  // for a dense model.
  ProcessGroup* data_group() const { return data_group_; }
  // The models this rank trains: the whole model, or its stages' parts
  // (each with the whole model's parameter names).
  const std::vector<models::Transformer*>& models() const { return models_; }
  // Every FSDP unit (each model's, root last).
  const std::vector<fsdp::FsdpUnit*>& units() const { return units_; }
  // Every sharded parameter (masters, gradients) in build order; frozen
  // ones (requires_grad false) have no gradient.
  const std::vector<fsdp::ShardedParameter*>& params() const { return params_; }
  AdamW& optimizer() { return *adamw_; }
  Step& step() { return *step_; }

 private:
  Training() = default;
  // Context parallelism's split over the cp ranks of this rank's shard
  // axis (cp > 1; nothing otherwise).
  absl::Status MakeContextParallel(const BuildOptions& options);
  // Expert parallelism (ep > 1): the mesh reshaped as the expert mesh and
  // the dispatcher over its ep axis.
  absl::Status MakeExpertParallel(const BuildOptions& options);
  absl::Status BuildModel(const BuildOptions& options);
  absl::Status BuildPipeline(const BuildOptions& options,
                             DeviceMesh* host_mesh);
  // DeepSeek-V3's auxiliary-loss-free balancing after a step: every MoE
  // layer's load (MoE::TakeLoad; taken every step), summed over the
  // data-parallel ranks, moves its expert bias by
  // model.moe.bias_update_rate (MoE::ExpertBiasUpdate) when `applied`: the
  // rows of its f32 master this rank holds, which the next forward gathers
  // (or the parameter itself when no FSDP unit holds it).
  absl::Status UpdateExpertBiases(bool applied);

  models::TransformerConfig config_;
  Layout layout_;
  DeviceMesh* mesh_ = nullptr;
  ProcessGroup* world_ = nullptr;
  // The data-parallel ranks of this rank's stage and tp coordinate (host),
  // with MoE layers: the expert loads are summed over them.
  ProcessGroup* data_group_ = nullptr;
  // Context parallelism's split (cp > 1), before the model that uses it.
  std::unique_ptr<nn::ContextParallel> context_parallel_;
  // Expert parallelism (layout ep > 1): the mesh reshaped as [pp,]
  // [replicate,] efsdp, ep [, tp] and the MoE layers' dispatcher over its ep
  // axis.
  std::unique_ptr<DeviceMesh> expert_mesh_;
  std::unique_ptr<parallel::ExpertParallel> expert_parallel_;
  std::unique_ptr<models::Transformer> model_;  // without pp
  std::vector<models::Transformer*> models_;
  std::vector<fsdp::FsdpUnit*> units_;
  std::vector<fsdp::ShardedParameter*> params_;
  std::unique_ptr<Step> step_;
  PipelineStep* pipeline_ = nullptr;  // step_, with pp
  double schedule_bubble_ = 0;
  std::optional<AdamW> adamw_;
  // values_on_device: per pending step its loss and squared gradient norm
  // (f32 [2 * kMaxPendingSteps] on the parameters' device); whether
  // ForwardBackward filled the next row's loss.
  bool values_on_device_ = false;
  Tensor step_values_;
  int64_t pending_steps_ = 0;
  bool loss_pending_ = false;
};

}  // namespace recipe
}  // namespace fsdpp

#endif  // FSDPP_RECIPE_TRAINING_H_
