// The build and the step of a run; see training.h.
#include "recipe/training.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/host_collectives.h"
#include "core/status.h"
#include "core/trace.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "nn/moe.h"
#include "optim/clip.h"
#include "parallel/pipeline_schedule.h"
#include "recipe/families.h"

namespace fsdpp {
namespace recipe {
namespace {

models::TransformerOptions ModelOptions(
    const Layout& layout, nn::ContextParallel* context_parallel = nullptr) {
  models::TransformerOptions options;
  options.context_parallel = context_parallel;
  options.activation_checkpointing = layout.activation_checkpointing;
  options.fused_attention = layout.fused_attention;
  options.loss_chunk_tokens = layout.loss_chunk_tokens;
  options.document_eot_id = layout.document_eot_id;
  return options;
}

// The FSDP plan's options on `mesh` (the whole mesh, or a stage's).
fsdp::FsdpPlanOptions FsdpOptions(const Layout& layout, DeviceMesh* mesh,
                                  Device host) {
  fsdp::FsdpPlanOptions options;
  options.shard.mesh = mesh;
  if (layout.tp > 1) options.shard.tp_axis = kTensorAxis;
  // ZeRO-1 keeps the parameters from the step's first forward to its last
  // backward.
  options.shard.reshard_after_forward =
      layout.reshard_after_forward && layout.reshard_after_backward;
  options.shard.hpz_degree = layout.hpz_degree > 1 ? layout.hpz_degree : 0;
  options.shard.mp_policy.param_dtype = layout.param_dtype;
  options.shard.mp_policy.reduce_dtype = layout.reduce_dtype;
  options.shard.offload_policy.offload_params = layout.offload;
  options.shard.offload_policy.host = host;
  return options;
}

models::TensorParallelPlanOptions TensorParallelOptions(
    const Layout& layout, absl::Duration timeout) {
  models::TensorParallelPlanOptions options;
  options.tp_axis = kTensorAxis;
  options.sequence_parallel = layout.sequence_parallel;
  options.loss_parallel = layout.loss_parallel;
  options.timeout = timeout;
  return options;
}

// Expert parallelism: the MoE layers' experts split over `ep` and each
// layer's experts made an FSDP unit of their own on the expert mesh (the ep
// split of the experts' dim and, with tp, the plan's split of their hidden
// as the piece axes, sharded over efsdp, averaged over every data-parallel
// rank); after the tensor-parallel plan, before the FSDP plan, whose units
// then leave them out.
absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ShardExpertUnits(
    models::Transformer* model, const Layout& layout, DeviceMesh* expert_mesh,
    parallel::ExpertParallel* ep, Device host) {
  std::vector<fsdp::FsdpUnit*> units;
  if (ep == nullptr) return units;
  FSDPP_RETURN_IF_ERROR(parallel::ShardExperts(*model, ep));
  fsdp::FullyShardOptions options =
      FsdpOptions(layout, expert_mesh, host).shard;
  options.ep_axis = kExpertAxis;
  options.gradient_divide_factor =
      static_cast<float>(layout.dp_replicate * layout.fsdp_shard());
  for (nn::MoE* moe : model->moe_layers()) {
    FSDPP_ASSIGN_OR_RETURN(fsdp::FsdpUnit * unit,
                           fsdp::FullyShard({moe->experts()}, options));
    units.push_back(unit);
  }
  return units;
}

// Both plans on one model (the whole one or a stage's part), with expert
// parallelism's units first when `ep` is given, then its sharded weights;
// its units. `where` names the part in errors.
absl::StatusOr<std::vector<fsdp::FsdpUnit*>> Parallelize(
    models::Transformer* model, const Layout& layout, DeviceMesh* mesh,
    const BuildOptions& options, const std::string& where,
    DeviceMesh* expert_mesh = nullptr, parallel::ExpertParallel* ep = nullptr) {
  FSDPP_ASSIGN_OR_RETURN(const FamilyPlans* plans,
                         PlansFor(model->config().family));
  // LoRA's adapters, then the frozen parameters, before the plans: FSDP
  // gives frozen ones no gradient (Layout::Validate checked the targets
  // and patterns against the whole model; a stage's part may miss some).
  if (layout.lora.enabled()) {
    FSDPP_RETURN_IF_ERROR(
        models::AddLoraAdapters(model, layout.lora, /*every_target=*/false)
            .status());
  }
  for (const auto& [name, p] : model->NamedParameters()) {
    if (layout.Frozen(name)) p->requires_grad = false;
  }
  if (layout.tp > 1) {
    FSDPP_RETURN_IF_ERROR(Annotate(
        plans->apply_tensor_parallel(
            model, mesh, TensorParallelOptions(layout, options.timeout)),
        "applying the tensor-parallel plan" + where));
  }
  absl::StatusOr<std::vector<fsdp::FsdpUnit*>> expert_units =
      ShardExpertUnits(model, layout, expert_mesh, ep, options.host);
  if (!expert_units.ok()) {
    return Annotate(expert_units.status(),
                    "applying expert parallelism" + where);
  }
  absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
      plans->apply_fsdp(model, FsdpOptions(layout, mesh, options.host));
  if (!units.ok()) {
    return Annotate(units.status(), "applying the FSDP plan" + where);
  }
  FSDPP_RETURN_IF_ERROR(fsdp::InitShardedWeights(model, options.seed));
  units->insert(units->begin(), expert_units->begin(), expert_units->end());
  return units;
}

bool SameAxes(const std::vector<MeshAxis>& a, const std::vector<MeshAxis>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].size != b[i].size) return false;
  }
  return true;
}

std::string AxesString(const std::vector<MeshAxis>& axes) {
  std::vector<std::string> parts;
  for (const MeshAxis& a : axes)
    parts.push_back(absl::StrCat(a.name, "=", a.size));
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Training>> Training::Build(
    const models::TransformerConfig& model, const Layout& layout,
    DeviceMesh* mesh, const BuildOptions& options) {
  FSDPP_RETURN_IF_ERROR(layout.Validate(model));
  DeviceMesh* host_mesh =
      options.host_mesh != nullptr ? options.host_mesh : mesh;
  for (DeviceMesh* m : {mesh, host_mesh}) {
    if (m == nullptr || !SameAxes(m->axes(), layout.MeshAxes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "recipe: the ", m == mesh ? "mesh " : "host mesh ",
          m == nullptr ? std::string("(none)") : AxesString(m->axes()),
          " is not the layout's ", AxesString(layout.MeshAxes())));
    }
  }
  std::unique_ptr<Training> t(new Training);
  t->config_ = model;
  t->layout_ = layout;
  t->mesh_ = mesh;
  FSDPP_ASSIGN_OR_RETURN(t->world_, host_mesh->FlatGroup());
  if (model.moe.enabled()) {
    FSDPP_ASSIGN_OR_RETURN(DeviceMesh * data,
                           host_mesh->SubMesh(layout.DataAxes()));
    FSDPP_ASSIGN_OR_RETURN(t->data_group_, data->FlatGroup());
  }
  if (layout.pp > 1) {
    FSDPP_RETURN_IF_ERROR(t->BuildPipeline(options, host_mesh));
  } else {
    FSDPP_RETURN_IF_ERROR(t->BuildModel(options));
  }
  // The ranks the loss is averaged over and the gradients are (a global
  // batch's token mean, MicroBatch::step_loss_tokens).
  FSDPP_RETURN_IF_ERROR(t->step_->set_loss_ranks(
      int64_t{layout.dp_replicate} * layout.dp_shard() * layout.cp));
  std::vector<AdamWParam> adam_params;
  for (fsdp::ShardedParameter* sp : t->params_) {
    if (!sp->requires_grad) continue;  // Frozen: no state.
    // Weight decay for matrices, by the parameters' own shapes (a
    // tensor-parallel master may be a view with more dims: GPT-2's fused
    // c_attn bias is [3, C] there).
    adam_params.emplace_back(sp->name, &sp->master, &sp->grad,
                             /*weight_decay=*/sp->shape.size() >= 2);
  }
  FSDPP_ASSIGN_OR_RETURN(AdamW adamw,
                         AdamW::Create(std::move(adam_params), options.adamw));
  t->adamw_.emplace(std::move(adamw));
  FSDPP_RETURN_IF_ERROR(t->adamw_->Init());
  t->values_on_device_ = options.step_values_on_device && layout.pp == 1 &&
                         layout.param_dtype != DType::kF16 && !layout.offload &&
                         !t->params_.empty();
  if (t->values_on_device_) {
    FSDPP_ASSIGN_OR_RETURN(
        t->step_values_,
        Tensor::Zeros({2 * kMaxPendingSteps}, DType::kF32,
                      t->params_.front()->master.local().device()));
  }
  return t;
}

absl::Status Training::MakeContextParallel(const BuildOptions& options) {
  if (layout_.cp == 1) return absl::OkStatus();
  // The cp ranks: consecutive coordinates of the shard axis.
  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * cp_group,
                         mesh_->Subgroup(kShardAxis, layout_.cp));
  FSDPP_ASSIGN_OR_RETURN(
      parallel::ContextLayout cp_layout,
      parallel::ContextLayout::Create(layout_.cp, layout_.seq(config_)));
  if (layout_.cp_style == "alltoall") {
    context_parallel_ = std::make_unique<parallel::UlyssesContextParallel>(
        cp_group, cp_layout, options.timeout);
  } else {
    context_parallel_ = std::make_unique<parallel::RingContextParallel>(
        cp_group, cp_layout, options.timeout);
  }
  return absl::OkStatus();
}

absl::Status Training::MakeExpertParallel(const BuildOptions& options) {
  FSDPP_ASSIGN_OR_RETURN(
      expert_mesh_, mesh_->Reshape(layout_.ExpertMeshAxes(),
                                   absl::StrCat(mesh_->name(), "-experts")));
  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * ep_group,
                         expert_mesh_->Group(kExpertAxis));
  expert_parallel_ =
      std::make_unique<parallel::ExpertParallel>(ep_group, options.timeout);
  return absl::OkStatus();
}

absl::Status Training::BuildModel(const BuildOptions& options) {
  FSDPP_RETURN_IF_ERROR(MakeContextParallel(options));
  if (layout_.ep > 1) FSDPP_RETURN_IF_ERROR(MakeExpertParallel(options));
  FSDPP_ASSIGN_OR_RETURN(
      model_, models::Transformer::Create(
                  config_, ModelOptions(layout_, context_parallel_.get())));
  FSDPP_ASSIGN_OR_RETURN(
      units_, Parallelize(model_.get(), layout_, mesh_, options, "",
                          expert_mesh_.get(), expert_parallel_.get()));
  models_ = {model_.get()};
  params_ = fsdp::ShardedParameters(model_.get());
  std::vector<DTensor*> grads;
  for (fsdp::ShardedParameter* sp : params_) {
    if (sp->requires_grad) grads.push_back(&sp->grad);
  }
  GradientSync sync{units_};
  // ZeRO-1: parameters gathered and gradients unsharded until the step's
  // last micro-batch.
  sync.every_micro_batch = layout_.reshard_after_backward;
  sync.reshard_after_backward = layout_.reshard_after_backward;
  step_ = std::make_unique<PlainStep>(model_.get(), std::move(grads),
                                      std::move(sync));
  return absl::OkStatus();
}

absl::Status Training::BuildPipeline(const BuildOptions& options,
                                     DeviceMesh* host_mesh) {
  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * pipeline, mesh_->Group(kPipelineAxis));
  FSDPP_ASSIGN_OR_RETURN(DeviceMesh * stage_mesh,
                         mesh_->SubMesh(layout_.StageAxes()));
  FSDPP_ASSIGN_OR_RETURN(
      parallel::PipelineSchedule schedule,
      parallel::MakePipelineSchedule(
          layout_.pp_schedule, layout_.pp, layout_.pp_virtual_stages,
          static_cast<int>(layout_.grad_accumulation)));
  FSDPP_ASSIGN_OR_RETURN(parallel::PipelineSimulation simulated,
                         parallel::Simulate(schedule, 1.0, 2.0));
  schedule_bubble_ = simulated.bubble;
  FSDPP_RETURN_IF_ERROR(MakeContextParallel(options));
  // Expert parallelism: the expert mesh [pp, replicate?, efsdp, ep, tp?],
  // the stages' experts sharded on its axes but pp.
  DeviceMesh* stage_expert_mesh = nullptr;
  if (layout_.ep > 1) {
    FSDPP_RETURN_IF_ERROR(MakeExpertParallel(options));
    std::vector<std::string> axes;
    for (const MeshAxis& a : layout_.ExpertMeshAxes()) {
      if (a.name != kPipelineAxis) axes.push_back(a.name);
    }
    FSDPP_ASSIGN_OR_RETURN(stage_expert_mesh, expert_mesh_->SubMesh(axes));
  }
  FSDPP_ASSIGN_OR_RETURN(
      std::vector<models::PipelineStagePart> parts,
      models::BuildPipelineParts(config_,
                                 ModelOptions(layout_, context_parallel_.get()),
                                 schedule, pipeline->rank(), layout_.pp_cuts));
  std::vector<PipelineStageTraining> stages;
  for (models::PipelineStagePart& part : parts) {
    PipelineStageTraining stage;
    FSDPP_ASSIGN_OR_RETURN(
        stage.units,
        Parallelize(part.model.get(), layout_, stage_mesh, options,
                    absl::StrCat(" of pipeline stage ", part.stage),
                    stage_expert_mesh, expert_parallel_.get()));
    for (fsdp::ShardedParameter* sp :
         fsdp::ShardedParameters(part.model.get())) {
      params_.push_back(sp);
      if (sp->requires_grad) stage.grads.push_back({sp->name, &sp->grad});
    }
    units_.insert(units_.end(), stage.units.begin(), stage.units.end());
    models_.push_back(part.model.get());
    stage.part = std::move(part);
    stages.push_back(std::move(stage));
  }
  PipelineStepOptions step_options;
  step_options.seq_split = layout_.sequence_parallel ? layout_.tp : 1;
  step_options.hidden_dtype = layout_.param_dtype;
  step_options.timeout = options.timeout;
  step_options.context_parallel = context_parallel_.get();
  step_options.norm_stage_reduced = layout_.ep > 1;
  FSDPP_ASSIGN_OR_RETURN(step_options.host_pipeline,
                         host_mesh->Group(kPipelineAxis));
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<PipelineStep> step,
                         PipelineStep::Create(pipeline, std::move(schedule),
                                              std::move(stages), step_options));
  pipeline_ = step.get();
  step_ = std::move(step);
  return absl::OkStatus();
}

absl::StatusOr<StepLoss> Training::ForwardBackward(
    const MicroBatchSource& source, double loss_scale, StepObserver* observer) {
  if (values_on_device_) {
    if (pending_steps_ == kMaxPendingSteps) {
      return absl::FailedPreconditionError(absl::StrCat(
          "recipe: ", pending_steps_,
          " steps' values are still on the device; ReadStepValues first"));
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor loss,
                           step_values_.Narrow(2 * pending_steps_, 1));
    loss_pending_ = false;
    FSDPP_ASSIGN_OR_RETURN(
        StepLoss out,
        step_->ForwardBackward(layout_.grad_accumulation, loss_scale, source,
                               observer, &loss));
    loss_pending_ = true;
    return out;
  }
  FSDPP_ASSIGN_OR_RETURN(StepLoss out,
                         step_->ForwardBackward(layout_.grad_accumulation,
                                                loss_scale, source, observer));
  std::vector<double> loss = {out.loss};
  FSDPP_RETURN_IF_ERROR(AllReduceValues(world_, &loss, ReduceOp::kAvg));
  out.loss = loss[0];
  return out;
}

absl::Status Training::UpdateExpertBiases(bool applied) {
  std::vector<nn::MoE*> layers;
  for (models::Transformer* m : models_) {
    for (nn::MoE* moe : m->moe_layers()) layers.push_back(moe);
  }
  std::vector<double> load;
  for (nn::MoE* moe : layers) {
    for (int64_t n : moe->TakeLoad()) load.push_back(static_cast<double>(n));
  }
  const double rate = config_.moe.bias_update_rate;
  if (!applied || !(rate > 0.0) || layers.empty()) return absl::OkStatus();
  FSDPP_RETURN_IF_ERROR(
      Annotate(AllReduceValues(data_group_, &load, ReduceOp::kSum),
               "the expert-bias update's loads"));
  const int64_t num_e = config_.moe.num_experts;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<double> delta = nn::MoE::ExpertBiasUpdate(
        std::vector<double>(load.begin() + i * num_e,
                            load.begin() + (i + 1) * num_e),
        rate);
    Parameter* bias = layers[i]->expert_bias();
    if (bias == nullptr) {
      return absl::FailedPreconditionError(
          "recipe: moe.bias_update_rate without an expert bias");
    }
    Tensor target = bias->data;
    int64_t first = 0;
    for (fsdp::ShardedParameter* sp : params_) {
      if (sp->parameter != bias) continue;
      target = *sp->master.mutable_local();
      first = sp->master.local_box().offset[0];
    }
    if (target.is_meta()) continue;  // a dry run: nothing to move
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> values, target.ToFloats());
    for (size_t j = 0; j < values.size(); ++j) {
      values[j] = static_cast<float>(values[j] + delta[first + j]);
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor updated,
                           Tensor::FromFloats(target.shape(), values,
                                              target.dtype(), target.device()));
    FSDPP_RETURN_IF_ERROR(Copy(updated, &target));
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimizerStepResult> Training::OptimizerStep(
    const OptimizerStepOptions& options, StepObserver* observer) {
  if (!values_on_device_) {
    FSDPP_ASSIGN_OR_RETURN(
        OptimizerStepResult out,
        recipe::OptimizerStep(*step_, *adamw_, options, observer));
    FSDPP_RETURN_IF_ERROR(UpdateExpertBiases(out.applied));
    return out;
  }
  if (!loss_pending_) {
    return absl::FailedPreconditionError(
        "recipe: OptimizerStep without a ForwardBackward before it");
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor loss,
                         step_values_.Narrow(2 * pending_steps_, 1));
  FSDPP_ASSIGN_OR_RETURN(Tensor norm_sq,
                         step_values_.Narrow(2 * pending_steps_ + 1, 1));
  OptimizerStepOptions on_device = options;
  on_device.device_loss = &loss;
  on_device.device_norm_sq = &norm_sq;
  FSDPP_ASSIGN_OR_RETURN(
      OptimizerStepResult out,
      recipe::OptimizerStep(*step_, *adamw_, on_device, observer));
  // (MoE runs on the CPU only, where the values stay on the host.)
  FSDPP_RETURN_IF_ERROR(UpdateExpertBiases(out.applied));
  loss_pending_ = false;
  ++pending_steps_;
  return out;
}

absl::StatusOr<std::vector<Training::StepValues>> Training::ReadStepValues() {
  std::vector<StepValues> out;
  if (loss_pending_) {
    return absl::FailedPreconditionError(
        "recipe: ReadStepValues between a ForwardBackward and its "
        "OptimizerStep");
  }
  if (!values_on_device_ || pending_steps_ == 0) return out;
  std::vector<float> values(2 * pending_steps_, 0.0f);
  if (!step_values_.is_meta()) {
    FSDPP_ASSIGN_OR_RETURN(Tensor rows,
                           step_values_.Narrow(0, 2 * pending_steps_));
    FSDPP_ASSIGN_OR_RETURN(values, rows.ToFloats());
  }
  std::vector<double> losses(pending_steps_);
  for (int64_t i = 0; i < pending_steps_; ++i) losses[i] = values[2 * i];
  FSDPP_RETURN_IF_ERROR(AllReduceValues(world_, &losses, ReduceOp::kAvg));
  out.resize(pending_steps_);
  for (int64_t i = 0; i < pending_steps_; ++i) {
    out[i].loss = losses[i];
    out[i].grad_norm = std::sqrt(static_cast<double>(values[2 * i + 1]));
  }
  pending_steps_ = 0;
  return out;
}

absl::StatusOr<double> Training::Evaluate(int64_t micro_batches,
                                          const MicroBatchSource& source) {
  FSDPP_ASSIGN_OR_RETURN(double sum, step_->EvaluateSum(micro_batches, source));
  // Free what the forward-only passes left gathered (the next training
  // forward would, but the memory between now and then is not needed).
  for (fsdp::FsdpUnit* unit : units_) FSDPP_RETURN_IF_ERROR(unit->Reshard());
  std::vector<double> mean = {sum / micro_batches};
  FSDPP_RETURN_IF_ERROR(AllReduceValues(world_, &mean, ReduceOp::kAvg));
  return mean[0];
}

std::vector<std::string> Training::Describe() const {
  std::vector<std::string> lines;
  if (pipeline_ != nullptr) {
    const parallel::PipelineSchedule& s = pipeline_->schedule();
    lines.push_back(absl::StrFormat(
        "pipeline: %s over %d stage(s) (%d per rank), %d micro-batches, "
        "stages start at blocks %s; bubble with equal stage times %.1f%%",
        s.name, s.stages(), s.virtual_stages, s.microbatches,
        layout_.pp_cuts.empty() ? std::string("(even split)")
                                : absl::StrJoin(layout_.pp_cuts, ","),
        100 * schedule_bubble_));
  }
  if (context_parallel_ != nullptr) {
    const int64_t seq = layout_.seq(config_), cp = layout_.cp;
    lines.push_back(absl::StrFormat(
        "context parallel: each sequence over cp %d ranks (%s; chunks of %d "
        "tokens, rank i holding chunks i and %d - i), FSDP over dp_shard %d "
        "x cp %d",
        cp,
        layout_.cp_style == "alltoall" ? "all-to-all attention over heads"
                                       : "ring attention",
        seq / (2 * cp), 2 * cp - 1, layout_.dp_shard(), cp));
  }
  return lines;
}

absl::StatusOr<std::string> Training::ReportTable(const Totals& totals) const {
  if (pipeline_ == nullptr) return std::string();
  const int world = layout_.world;
  const int rank = world_->rank();
  std::vector<double> per_rank(2 * world, 0.0);
  const double busy = totals.compute_seconds + totals.wait_seconds;
  per_rank[2 * rank] = busy > 0 ? totals.wait_seconds / busy : 0;
  per_rank[2 * rank + 1] = static_cast<double>(totals.peak_held_bytes);
  FSDPP_RETURN_IF_ERROR(AllReduceValues(world_, &per_rank, ReduceOp::kSum));
  const parallel::PipelineSchedule& s = pipeline_->schedule();
  std::string table = absl::StrFormat(
      "Pipeline (%s, %d micro-batches; bubble with equal stage times %.1f%%):\n"
      "  rank  stage(s)  waiting  held for backward",
      s.name, s.microbatches, 100 * schedule_bubble_);
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> stages;
    for (int stage = layout_.PipelineRankOf(r); stage < s.stages();
         stage += layout_.pp) {
      stages.push_back(absl::StrCat(stage));
    }
    absl::StrAppend(&table, absl::StrFormat("\n  %4d  %-8s  %6.1f%%  %.1f MiB",
                                            r, absl::StrJoin(stages, ","),
                                            100 * per_rank[2 * r],
                                            per_rank[2 * r + 1] / 1048576.0));
  }
  return table;
}

}  // namespace recipe
}  // namespace fsdpp
