// The training step; see step.h.
#include "recipe/step/step.h"

#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "comm/host_collectives.h"
#include "core/status.h"
#include "core/trace.h"
#include "optim/clip.h"

namespace fsdpp {
namespace recipe {
namespace {

// StepObserver's defaults, for a step nobody watches.
StepObserver* Quiet() {
  static StepObserver* const quiet = new StepObserver;
  return quiet;
}

absl::StatusOr<MicroBatch> Fetch(const MicroBatchSource& source,
                                 int64_t index) {
  TraceSpan span("data", "data");
  return source(index);
}

absl::Status CheckCount(int64_t micro_batches) {
  if (micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step: ", micro_batches, " micro-batches; at least one is needed"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Step::set_loss_ranks(int64_t ranks) {
  if (ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: ", ranks, " loss ranks; at least one is needed"));
  }
  loss_ranks_ = ranks;
  return absl::OkStatus();
}

absl::Status Step::NormaliseLoss(nn::LossFunction* loss,
                                 const MicroBatch& first,
                                 int64_t micro_batches) const {
  if (loss == nullptr) return absl::OkStatus();
  if (first.step_loss_tokens < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: step_loss_tokens ", first.step_loss_tokens,
                     " (>= 0, or -1 for per-micro-batch means)"));
  }
  if (first.step_loss_tokens == -1) return loss->set_normalizer(0);
  // Counted targets per micro-batch and rank on average; 0 (nothing counted
  // anywhere) leaves every micro-batch's loss 0 through its count.
  return loss->set_normalizer(
      static_cast<double>(first.step_loss_tokens) /
      (static_cast<double>(micro_batches) * static_cast<double>(loss_ranks_)));
}

absl::Status Step::CheckLossTokens(const MicroBatch& first,
                                   const MicroBatch& batch, int64_t index) {
  if (batch.step_loss_tokens == first.step_loss_tokens) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("step: micro-batch ", index, " says the step counts ",
                   batch.step_loss_tokens, " loss targets, micro-batch 0 said ",
                   first.step_loss_tokens));
}

absl::StatusOr<std::vector<uint64_t>> Step::RowKeys(const MicroBatch& batch,
                                                    int64_t index,
                                                    int64_t rows) const {
  if (!batch.row_keys.empty()) {
    if (static_cast<int64_t>(batch.row_keys.size()) != rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("step: micro-batch ", index, " has ",
                       batch.row_keys.size(), " row keys for ", rows, " rows"));
    }
    return batch.row_keys;
  }
  // The top bit apart from a loader's keys (epoch << 40 | window).
  std::vector<uint64_t> keys(rows);
  for (int64_t r = 0; r < rows; ++r) {
    keys[r] = (uint64_t{1} << 63) | (static_cast<uint64_t>(steps_) << 32) |
              (static_cast<uint64_t>(index) << 16) | static_cast<uint64_t>(r);
  }
  return keys;
}

PlainStep::PlainStep(models::Transformer* model, std::vector<DTensor*> grads,
                     GradientSync sync)
    : model_(model), grads_(std::move(grads)), sync_(std::move(sync)) {
  absl::flat_hash_set<const DTensor*> lazy;
  for (fsdp::FsdpUnit* u : sync_.units) {
    for (const fsdp::ShardedParameter& sp : u->parameters()) {
      lazy.insert(&sp.grad);
    }
  }
  for (DTensor* g : grads_) {
    if (!lazy.contains(g)) eager_grads_.push_back(g);
  }
}

void PlainStep::SetSync(bool last) {
  const bool sync = sync_.every_micro_batch || last;
  for (fsdp::FsdpUnit* u : sync_.units) {
    u->SetRequiresGradientSync(sync);
    u->SetReshardAfterBackward(last || sync_.reshard_after_backward);
    // HSDP: the replicas all-reduce the step's gradient once, on the last
    // micro-batch (each micro-batch still reduce-scatters in the shard
    // group).
    u->SetRequiresAllReduce(last);
  }
  if (sync_.replicated != nullptr) {
    sync_.replicated->SetRequiresGradientSync(sync);
  }
}

absl::StatusOr<StepLoss> PlainStep::ForwardBackward(
    int64_t micro_batches, double loss_scale, const MicroBatchSource& source,
    StepObserver* observer, Tensor* device_loss) {
  FSDPP_RETURN_IF_ERROR(CheckCount(micro_batches));
  if (observer == nullptr) observer = Quiet();
  FSDPP_RETURN_IF_ERROR(ZeroGrad(eager_grads_));
  for (fsdp::FsdpUnit* u : sync_.units) u->ZeroGradOnNextReduction();
  if (device_loss != nullptr) {
    FSDPP_RETURN_IF_ERROR(Annotate(Zero(device_loss), "step: device_loss"));
  }
  const int64_t run = observer->MicroBatchesToRun(micro_batches);
  if (run < 1 || run > micro_batches) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: the observer asked to run ", run, " of ",
                     micro_batches, " micro-batches"));
  }
  const float backward_scale =
      1.0f / static_cast<float>(micro_batches) * static_cast<float>(loss_scale);
  model_->SetAuxLossScale(backward_scale);
  StepLoss out;
  MicroBatch first;
  for (int64_t m = 0; m < run; ++m) {
    SetSync(m + 1 == run);
    observer->MicroBatchBegins(m, run);
    FSDPP_ASSIGN_OR_RETURN(MicroBatch batch, Fetch(source, m));
    if (m == 0) {
      first.step_loss_tokens = batch.step_loss_tokens;
      FSDPP_RETURN_IF_ERROR(
          NormaliseLoss(model_->mutable_loss(), batch, micro_batches));
    }
    FSDPP_RETURN_IF_ERROR(CheckLossTokens(first, batch, m));
    {
      FSDPP_ASSIGN_OR_RETURN(
          std::vector<uint64_t> keys,
          RowKeys(batch, m, batch.ids.ndim() > 0 ? batch.ids.dim(0) : 0));
      model_->SetDropoutRows(std::move(keys));
    }
    float loss = 0;
    {
      TraceSpan span("forward", "compute");
      if (device_loss != nullptr) {
        FSDPP_RETURN_IF_ERROR(
            Annotate(model_->ForwardLossAccumulate(
                         batch.ids, batch.targets,
                         1.0 / static_cast<double>(micro_batches), device_loss),
                     "forward"));
      } else {
        absl::StatusOr<float> l = model_->ForwardLoss(batch.ids, batch.targets);
        if (!l.ok()) return Annotate(l.status(), "forward");
        loss = *l;
      }
    }
    observer->PhaseEnded(absl::StrCat("forward ", m + 1));
    {
      TraceSpan span("backward", "compute");
      FSDPP_RETURN_IF_ERROR(
          Annotate(model_->Backward(backward_scale), "backward"));
    }
    observer->PhaseEnded(absl::StrCat("backward ", m + 1));
    observer->MicroBatchEnded(m, run);
    out.loss += static_cast<double>(loss) / micro_batches;
  }
  for (fsdp::FsdpUnit* u : sync_.units) {
    FSDPP_RETURN_IF_ERROR(u->FinishZeroGrad());
  }
  CountStep();
  if (device_loss != nullptr) out.loss = std::nan("");
  return out;
}

absl::StatusOr<double> PlainStep::EvaluateSum(int64_t micro_batches,
                                              const MicroBatchSource& source) {
  FSDPP_RETURN_IF_ERROR(CheckCount(micro_batches));
  double sum = 0;
  MicroBatch first;
  for (int64_t m = 0; m < micro_batches; ++m) {
    FSDPP_ASSIGN_OR_RETURN(MicroBatch batch, source(m));
    if (m == 0) {
      first.step_loss_tokens = batch.step_loss_tokens;
      FSDPP_RETURN_IF_ERROR(
          NormaliseLoss(model_->mutable_loss(), batch, micro_batches));
    }
    FSDPP_RETURN_IF_ERROR(CheckLossTokens(first, batch, m));
    FSDPP_ASSIGN_OR_RETURN(float loss,
                           model_->EvalLoss(batch.ids, batch.targets));
    sum += loss;
  }
  return sum;
}

PipelineStep::PipelineStep(ProcessGroup* pipeline,
                           parallel::PipelineSchedule schedule,
                           std::vector<PipelineStageTraining> stages,
                           PipelineStepOptions options)
    : pipeline_(pipeline), schedule_(std::move(schedule)), options_(options) {
  norm_.pipeline = pipeline;
  norm_.stage_reduced = options.norm_stage_reduced;
  for (PipelineStageTraining& stage : stages) {
    const models::Transformer& model = *stage.part.model;
    const std::string tied = models::TiedWeightName(model.config());
    for (const StageGrad& g : stage.grads) {
      grads_.push_back(g.grad);
      norm_.counts.push_back(models::CountsInNorm(model, g.name));
      // Two copies of the tied weight only when its embedding and head are
      // on different stages.
      if (g.name != tied || (model.has_embedding() && model.has_head())) {
        continue;
      }
      (model.has_embedding() ? tied_first_ : tied_last_) =
          g.grad->mutable_local();
    }
    all_units_.insert(all_units_.end(), stage.units.begin(), stage.units.end());
    units_[stage.part.stage] = std::move(stage.units);
    parts_.push_back(std::move(stage.part));
  }
}

absl::StatusOr<std::unique_ptr<PipelineStep>> PipelineStep::Create(
    ProcessGroup* pipeline, parallel::PipelineSchedule schedule,
    std::vector<PipelineStageTraining> stages, PipelineStepOptions options) {
  if (pipeline == nullptr || stages.empty() || options.seq_split < 1) {
    return absl::InvalidArgumentError(
        "PipelineStep: needs the pipeline group, at least one stage and a "
        "positive seq_split");
  }
  for (const PipelineStageTraining& stage : stages) {
    if (stage.part.model == nullptr ||
        schedule.RankOf(stage.part.stage) != pipeline->rank()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PipelineStep: stage ", stage.part.stage,
          " is not one of pipeline rank ", pipeline->rank(), "'s"));
    }
  }
  return std::unique_ptr<PipelineStep>(new PipelineStep(
      pipeline, std::move(schedule), std::move(stages), options));
}

absl::Status PipelineStep::Gather(int64_t micro_batches,
                                  const MicroBatchSource& source,
                                  std::vector<Tensor>* ids,
                                  std::vector<Tensor>* targets) {
  FSDPP_RETURN_IF_ERROR(CheckCount(micro_batches));
  row_keys_.clear();
  {
    TraceSpan span("data", "data");
    MicroBatch first;
    for (int64_t m = 0; m < micro_batches; ++m) {
      FSDPP_ASSIGN_OR_RETURN(MicroBatch batch, source(m));
      if (m == 0) {
        first.step_loss_tokens = batch.step_loss_tokens;
        // The loss lives on the part with the head.
        for (models::PipelineStagePart& part : parts_) {
          if (!part.model->has_head()) continue;
          FSDPP_RETURN_IF_ERROR(
              NormaliseLoss(part.model->mutable_loss(), batch, micro_batches));
        }
      }
      FSDPP_RETURN_IF_ERROR(CheckLossTokens(first, batch, m));
      FSDPP_ASSIGN_OR_RETURN(
          std::vector<uint64_t> keys,
          RowKeys(batch, m, batch.ids.ndim() > 0 ? batch.ids.dim(0) : 0));
      row_keys_.push_back(std::move(keys));
      ids->push_back(std::move(batch.ids));
      targets->push_back(std::move(batch.targets));
    }
  }
  const Tensor& first = ids->front();
  const nn::ContextParallel* cp = options_.context_parallel;
  // This rank's tokens of a row (its columns under context parallelism).
  const int64_t seq = first.shape().size() != 2 ? 0
                      : cp != nullptr           ? cp->local()
                                                : first.dim(1);
  if (first.shape().size() != 2 || seq % options_.seq_split != 0 ||
      (cp != nullptr && first.dim(1) != cp->seq_len())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: micro-batch ids ", ShapeToString(first.shape()),
        " are not [rows, seq] with seq",
        cp != nullptr ? absl::StrCat(" = ", cp->seq_len(), " and ") : " ",
        "this rank's tokens divisible by ", options_.seq_split));
  }
  if (cp != nullptr) {
    for (Tensor& t : *targets) {
      FSDPP_ASSIGN_OR_RETURN(t, cp->Local(t));
    }
  }
  batch_ids_ = *ids;
  const Shape hidden = {first.dim(0), seq / options_.seq_split,
                        parts_.front().model->config().dim};
  if (runner_ != nullptr) {
    if (hidden == hidden_) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: micro-batches of ", ShapeToString(first.shape()),
        " after ones whose hidden states were ", ShapeToString(hidden_)));
  }
  models::PipelineStageModules modules =
      models::StageModules(parts_, hidden, options_.hidden_dtype);
  parallel::PipelineRunnerOptions runner_options;
  runner_options.timeout = options_.timeout;
  // FSDP syncs each stage's gradients once, on its last backward.
  runner_options.on_last_backward = [this](int stage) {
    for (fsdp::FsdpUnit* u : units_[stage]) u->SetRequiresGradientSync(true);
    return absl::OkStatus();
  };
  // The parts without the embeddings get each micro-batch's ids; a
  // training forward its rows' dropout keys.
  runner_options.before_forward = [this](int stage, int mb) -> absl::Status {
    for (models::PipelineStagePart& part : parts_) {
      if (part.stage != stage) continue;
      if (mb < 0 || mb >= static_cast<int>(batch_ids_.size()) ||
          mb >= static_cast<int>(row_keys_.size())) {
        return absl::InternalError("pipeline: no ids for this micro-batch");
      }
      if (training_) part.model->SetDropoutRows(row_keys_[mb]);
      if (part.model->has_embedding()) return absl::OkStatus();
      return part.model->SetBatch(batch_ids_[mb]);
    }
    return absl::OkStatus();
  };
  FSDPP_ASSIGN_OR_RETURN(
      runner_, parallel::PipelineRunner::Create(pipeline_, schedule_,
                                                std::move(modules.stages),
                                                modules.loss, runner_options));
  hidden_ = hidden;
  return absl::OkStatus();
}

absl::StatusOr<StepLoss> PipelineStep::ForwardBackward(
    int64_t micro_batches, double loss_scale, const MicroBatchSource& source,
    StepObserver* observer, Tensor* device_loss) {
  if (observer == nullptr) observer = Quiet();
  if (device_loss != nullptr) {
    return absl::InvalidArgumentError(
        "pipeline: the loss lives on the last stage and is summed over the "
        "pipeline on the host; a device_loss is not supported");
  }
  if (micro_batches != schedule_.microbatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: ", micro_batches, " micro-batches for a schedule of ",
        schedule_.microbatches));
  }
  FSDPP_RETURN_IF_ERROR(ZeroGrad(grads_));
  std::vector<Tensor> ids, targets;
  FSDPP_RETURN_IF_ERROR(Gather(micro_batches, source, &ids, &targets));
  for (fsdp::FsdpUnit* u : all_units_) u->SetRequiresGradientSync(false);
  for (models::PipelineStagePart& part : parts_) {
    part.model->SetAuxLossScale(static_cast<float>(loss_scale / micro_batches));
  }
  training_ = true;
  absl::StatusOr<parallel::PipelineStepStats> stats = runner_->Step(
      ids, targets, static_cast<float>(loss_scale / micro_batches));
  training_ = false;
  CountStep();
  if (!stats.ok()) return Annotate(stats.status(), "pipeline");
  FSDPP_RETURN_IF_ERROR(parallel::SumSharedGradients(
      pipeline_, schedule_, tied_first_, tied_last_, options_.timeout));
  observer->PhaseEnded("pipeline");
  StepLoss out;
  out.compute_seconds = stats->compute_seconds;
  out.wait_seconds = stats->wait_seconds;
  out.peak_held_bytes = stats->peak_held_bytes;
  // The loss lives on the last stage's rank: the others add zeros.
  std::vector<double> loss = {0.0};
  for (float l : stats->losses) {
    loss[0] += static_cast<double>(l) / micro_batches;
  }
  FSDPP_RETURN_IF_ERROR(AllReduceValues(HostPipeline(), &loss, ReduceOp::kSum));
  out.loss = loss[0];
  return out;
}

absl::StatusOr<double> PipelineStep::EvaluateSum(
    int64_t micro_batches, const MicroBatchSource& source) {
  std::vector<Tensor> ids, targets;
  FSDPP_RETURN_IF_ERROR(Gather(micro_batches, source, &ids, &targets));
  FSDPP_ASSIGN_OR_RETURN(
      std::vector<float> losses,
      runner_->Evaluate(static_cast<int>(micro_batches), ids, targets));
  std::vector<double> sum = {0.0};
  for (float l : losses) sum[0] += l;
  FSDPP_RETURN_IF_ERROR(AllReduceValues(HostPipeline(), &sum, ReduceOp::kSum));
  return sum[0];
}

absl::StatusOr<OptimizerStepResult> OptimizerStep(
    Step& step, AdamW& adamw, const OptimizerStepOptions& options,
    StepObserver* observer) {
  const std::vector<DTensor*>& grads = step.grads();
  OptimizerStepResult out;
  if ((options.device_loss == nullptr) != (options.device_norm_sq == nullptr)) {
    return absl::InvalidArgumentError(
        "OptimizerStep: device_loss and device_norm_sq go together");
  }
  if (options.device_loss != nullptr) {
    if (options.scaler != nullptr) {
      return absl::InvalidArgumentError(
          "OptimizerStep: the loss scaler reads its overflow check back; it "
          "does not run with the step's values on the device");
    }
    {
      TraceSpan span("clip", "optimizer");
      FSDPP_RETURN_IF_ERROR(GradNormSquaredOnDevice(grads, step.norm_options(),
                                                    options.device_norm_sq,
                                                    kHostCollectiveTimeout));
    }
    TraceSpan span("optimizer", "optimizer");
    FSDPP_RETURN_IF_ERROR(adamw.SetLr(options.lr));
    AdamW::StepGuard guard;
    guard.loss = options.device_loss;
    guard.norm_sq = options.device_norm_sq;
    guard.max_norm = options.grad_clip > 0 ? options.grad_clip : 0.0;
    FSDPP_RETURN_IF_ERROR(adamw.Step(guard));
    out.grad_norm = std::nan("");
    out.applied = true;
    out.on_device = true;
    if (observer != nullptr) observer->PhaseEnded("optimizer");
    return out;
  }
  if (options.scaler != nullptr) {
    TraceSpan span("unscale", "optimizer");
    FSDPP_ASSIGN_OR_RETURN(bool finite, options.scaler->UnscaleAndCheck(
                                            grads, kHostCollectiveTimeout));
    options.scaler->Update(!finite);
    out.skipped = !finite;
  }
  if (out.skipped) {
    out.grad_norm = std::nan("");
  } else {
    {
      TraceSpan span("clip", "optimizer");
      FSDPP_ASSIGN_OR_RETURN(out.grad_norm, GradNorm(grads, step.norm_options(),
                                                     kHostCollectiveTimeout));
    }
    if (std::isfinite(out.grad_norm)) {
      TraceSpan span("optimizer", "optimizer");
      FSDPP_RETURN_IF_ERROR(adamw.SetLr(options.lr));
      // Clipping is AdamW's grad_scale: the same update as scaling the
      // gradients first, without a pass of its own over them.
      FSDPP_RETURN_IF_ERROR(
          adamw.Step(options.grad_clip > 0
                         ? ClipCoefficient(out.grad_norm, options.grad_clip)
                         : 1.0f));
      out.applied = true;
    }
  }
  if (observer != nullptr) observer->PhaseEnded("optimizer");
  return out;
}

}  // namespace recipe
}  // namespace fsdpp
