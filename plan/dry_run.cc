// DryRun; see dry_run.h.
#include "plan/dry_run.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/gpt2/parallelize.h"
#include "models/llama/parallelize.h"
#include "models/transformer.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "parallel/pipeline_runner.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace plan {

std::string Strategy::ToString() const {
  std::string mesh = absl::StrCat("W=", world);
  if (dp_replicate > 1) {
    absl::StrAppend(&mesh, " (", dp_replicate, " x ", dp_shard(), " HSDP)");
  }
  if (tp > 1) {
    absl::StrAppend(&mesh, " x TP ", tp, sequence_parallel ? " + SP" : "",
                    loss_parallel ? " + loss parallel" : "");
  }
  if (pp > 1) {
    absl::StrAppend(&mesh, " x PP ", pp, " ", pp_schedule,
                    pp_virtual_stages > 1
                        ? absl::StrCat(" (", pp_virtual_stages, " stages/rank)")
                        : std::string());
  }
  return absl::StrFormat(
      "%s, %s%s, %s/%s%s%s, %s attention, batch %d x %d x %d", mesh,
      reshard_after_forward ? "ZeRO-3" : "ZeRO-2",
      hpz_degree > 1 ? absl::StrCat(" hpZ ", hpz_degree) : std::string(),
      DTypeName(param_dtype), DTypeName(reduce_dtype),
      activation_checkpointing ? ", AC" : "", offload ? ", offload" : "",
      fused_attention ? "fused" : "unfused", micro_batch, seq_len,
      grad_accumulation);
}

absl::Status CheckStrategy(const models::TransformerConfig& config,
                           const Strategy& s) {
  if (s.world < 1 || s.dp_replicate < 1 || s.tp < 1 || s.pp < 1 ||
      s.world % (s.dp_replicate * s.tp * s.pp) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan: world ", s.world, " must be a positive multiple of the ",
        s.dp_replicate, " replicas x tp ", s.tp, " x pp ", s.pp));
  }
  if ((s.sequence_parallel || s.loss_parallel) && s.tp < 2) {
    return absl::InvalidArgumentError(
        "plan: sequence and loss parallelism need tp > 1");
  }
  if (s.sequence_parallel && s.seq(config) % s.tp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: sequence parallelism splits seq_len ",
                     s.seq(config), " over tp ", s.tp, ": it must divide"));
  }
  if (s.hpz_degree > 1 && s.dp_shard() % s.hpz_degree != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: hpZ degree ", s.hpz_degree,
                     " must divide the shard group of ", s.dp_shard()));
  }
  if (s.micro_batch < 1 || s.grad_accumulation < 1 || s.seq_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan: micro-batch ", s.micro_batch, ", accumulation ",
        s.grad_accumulation, " must be >= 1 and seq_len ", s.seq_len, " >= 0"));
  }
  if (s.seq(config) > config.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: seq_len ", s.seq(config), " is over ", config.name,
                     "'s context length ", config.context_length));
  }
  for (DType d : {s.param_dtype, s.reduce_dtype}) {
    if (!IsFloatingPoint(d)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan: ", DTypeName(d), " is not a floating-point dtype"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyFamilyFsdpPlan(
    models::Transformer* model, const fsdp::FsdpPlanOptions& options) {
  switch (model->config().family) {
    case models::ModelFamily::kGpt2:
      return models::gpt2::ApplyFsdp(model, options);
    case models::ModelFamily::kLlama:
      return models::llama::ApplyFsdp(model, options);
  }
  return absl::InvalidArgumentError("unknown model family");
}

std::vector<MeshAxis> MeshAxesFor(const Strategy& strategy) {
  std::vector<MeshAxis> axes;
  if (strategy.pp > 1) axes.push_back({"pp", strategy.pp});
  if (strategy.dp_replicate > 1) {
    axes.push_back({"replicate", strategy.dp_replicate});
  }
  axes.push_back({"shard", strategy.dp_shard()});
  if (strategy.tp > 1) axes.push_back({"tp", strategy.tp});
  return axes;
}

models::TransformerOptions ModelOptionsFor(const Strategy& strategy) {
  models::TransformerOptions mo;
  mo.activation_checkpointing = strategy.activation_checkpointing;
  mo.fused_attention = strategy.fused_attention;
  return mo;
}

fsdp::FsdpPlanOptions FsdpOptionsFor(const Strategy& strategy, DeviceMesh* mesh,
                                     Device host) {
  fsdp::FsdpPlanOptions po;
  po.shard.mesh = mesh;
  if (strategy.tp > 1) po.shard.tp_axis = "tp";
  po.shard.reshard_after_forward = strategy.reshard_after_forward;
  po.shard.hpz_degree = strategy.hpz_degree > 1 ? strategy.hpz_degree : 0;
  po.shard.mp_policy.param_dtype = strategy.param_dtype;
  po.shard.mp_policy.reduce_dtype = strategy.reduce_dtype;
  po.shard.offload_policy.offload_params = strategy.offload;
  po.shard.offload_policy.host = host;
  return po;
}

models::TensorParallelPlanOptions TensorParallelOptionsFor(
    const Strategy& strategy) {
  models::TensorParallelPlanOptions tpo;
  tpo.tp_axis = "tp";
  tpo.sequence_parallel = strategy.sequence_parallel;
  tpo.loss_parallel = strategy.loss_parallel;
  return tpo;
}

absl::StatusOr<DeviceMesh*> StageMesh(DeviceMesh* mesh) {
  std::vector<std::string> axes;
  for (const MeshAxis& a : mesh->axes()) {
    if (a.name != "pp") axes.push_back(a.name);
  }
  return mesh->SubMesh(axes);
}

absl::Status ApplyFamilyTensorParallelPlan(
    models::Transformer* model, DeviceMesh* mesh,
    const models::TensorParallelPlanOptions& options) {
  switch (model->config().family) {
    case models::ModelFamily::kGpt2:
      return models::gpt2::ApplyTensorParallel(model, mesh, options);
    case models::ModelFamily::kLlama:
      return models::llama::ApplyTensorParallel(model, mesh, options);
  }
  return absl::InvalidArgumentError("unknown model family");
}

absl::StatusOr<PipelineStages> BuildPipelineStages(
    const models::TransformerConfig& config,
    const models::TransformerOptions& options,
    const parallel::PipelineSchedule& schedule, int pp_rank,
    const std::vector<int>& cuts, const fsdp::FsdpPlanOptions& fsdp_plan,
    const models::TensorParallelPlanOptions* tp_plan, uint64_t seed) {
  PipelineStages out;
  ASSIGN_OR_RETURN(out.parts, models::BuildPipelineParts(
                                  config, options, schedule, pp_rank, cuts));
  const std::string tied = models::TiedWeightName(config);
  for (models::PipelineStagePart& part : out.parts) {
    models::Transformer* m = part.model.get();
    const std::string stage = absl::StrCat(" of pipeline stage ", part.stage);
    if (tp_plan != nullptr) {
      RETURN_IF_ERROR(Annotate(
          ApplyFamilyTensorParallelPlan(m, fsdp_plan.shard.mesh, *tp_plan),
          "applying the tensor-parallel plan" + stage));
    }
    absl::StatusOr<std::vector<fsdp::FsdpUnit*>> planned =
        ApplyFamilyFsdpPlan(m, fsdp_plan);
    if (!planned.ok()) {
      return Annotate(planned.status(), "applying the FSDP plan" + stage);
    }
    std::vector<fsdp::FsdpUnit*> units = *std::move(planned);
    RETURN_IF_ERROR(fsdp::InitShardedWeights(m, seed));
    out.units.insert(out.units.end(), units.begin(), units.end());
    out.units_by_stage[part.stage] = std::move(units);
    for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(m)) {
      out.params.push_back(sp);
      out.counts_in_norm.push_back(models::CountsInNorm(*m, sp->name));
      // Two copies of the tied weight only when its embedding and head are
      // on different stages.
      if (sp->name != tied || (m->has_embedding() && m->has_head())) continue;
      (m->has_embedding() ? out.tied_first : out.tied_last) =
          sp->grad.mutable_local();
    }
  }
  return out;
}

namespace {

// The allocator's view of one phase, and its peak folded into the step's.
// With `host` (another allocator than the device's: offloaded state counted
// apart) its figures too.
class PhaseRecorder {
 public:
  PhaseRecorder(Allocator* device, Allocator* host, DryRunResult* result)
      : device_(device), host_(host), result_(result) {}
  void Begin() {
    device_->ResetPeak();
    if (host_ != nullptr) host_->ResetPeak();
  }
  void End(std::string name) {
    PhaseMemory phase{name, device_->Stats(), {}};
    if (phase.stats.total_peak > result_->peak_bytes) {
      result_->peak_bytes = phase.stats.total_peak;
      result_->peak_phase = name;
    }
    if (host_ != nullptr) {
      phase.host = host_->Stats();
      result_->host_peak_bytes =
          std::max(result_->host_peak_bytes, phase.host.total_peak);
    }
    result_->phases.push_back(std::move(phase));
  }

 private:
  Allocator* device_;
  Allocator* host_;
  DryRunResult* result_;
};

absl::Status Step(const models::TransformerConfig& config,
                  const Strategy& strategy, int rank,
                  ProcessGroupFactory factory, Device device, Device host,
                  SimulatedOpLog* log, DryRunResult* result) {
  Allocator* acct = GetAllocator(device);
  Allocator* host_acct = host == device ? nullptr : GetAllocator(host);
  if (acct == nullptr || (host != device && host_acct == nullptr)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "plan: no allocator for ", device.ToString(), " or ", host.ToString()));
  }
  ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceMesh> mesh,
      DeviceMesh::Create(MeshAxesFor(strategy), rank, strategy.world,
                         std::move(factory), "train"));
  PhaseRecorder phases(acct, host_acct, result);
  phases.Begin();
  const models::TransformerOptions mo = ModelOptionsFor(strategy);
  result->model_params = models::NumParameters(config);
  const models::TensorParallelPlanOptions tpo =
      TensorParallelOptionsFor(strategy);
  fsdp::FsdpPlanOptions po = FsdpOptionsFor(strategy, mesh.get(), host);
  // Without pipeline parallelism the whole model (trainer.cc BuildModel);
  // with it this rank's stages and the runner (BuildPipeline).
  std::unique_ptr<models::Transformer> model;
  PipelineStages stages;
  std::unique_ptr<parallel::PipelineRunner> runner;
  ProcessGroup* pp_group = nullptr;
  std::vector<fsdp::ShardedParameter*> params;
  std::vector<fsdp::FsdpUnit*> units;  // without pipeline parallelism
  if (strategy.pp > 1) {
    ASSIGN_OR_RETURN(pp_group, mesh->Group("pp"));
    ASSIGN_OR_RETURN(po.shard.mesh, StageMesh(mesh.get()));
    ASSIGN_OR_RETURN(
        parallel::PipelineSchedule schedule,
        models::MakePipelineSchedule(
            strategy.pp_schedule, strategy.pp, strategy.pp_virtual_stages,
            static_cast<int>(strategy.grad_accumulation)));
    ASSIGN_OR_RETURN(stages,
                     BuildPipelineStages(config, mo, schedule, pp_group->rank(),
                                         strategy.pp_cuts, po,
                                         strategy.tp > 1 ? &tpo : nullptr, 0));
    params = stages.params;
    const int64_t seq = strategy.sequence_parallel
                            ? strategy.seq(config) / strategy.tp
                            : strategy.seq(config);
    models::PipelineStageModules modules = models::StageModules(
        stages.parts, {strategy.micro_batch, seq, config.dim},
        strategy.param_dtype);
    parallel::PipelineRunnerOptions ro;
    std::map<int, std::vector<fsdp::FsdpUnit*>>* by_stage =
        &stages.units_by_stage;
    ro.on_last_backward = [by_stage](int stage) {
      for (fsdp::FsdpUnit* u : (*by_stage)[stage]) {
        u->SetRequiresGradientSync(true);
      }
      return absl::OkStatus();
    };
    ASSIGN_OR_RETURN(parallel::PipelineSimulation sim,
                     parallel::Simulate(schedule, 1.0, 2.0));
    result->pipeline_bubble = sim.bubble;
    ASSIGN_OR_RETURN(runner, parallel::PipelineRunner::Create(
                                 pp_group, std::move(schedule),
                                 std::move(modules.stages), modules.loss, ro));
  } else {
    ASSIGN_OR_RETURN(model, models::Transformer::Create(config, mo));
    if (strategy.tp > 1) {
      RETURN_IF_ERROR(
          ApplyFamilyTensorParallelPlan(model.get(), mesh.get(), tpo));
    }
    ASSIGN_OR_RETURN(units, ApplyFamilyFsdpPlan(model.get(), po));
    RETURN_IF_ERROR(fsdp::InitShardedWeights(model.get(), 0));
    params = fsdp::ShardedParameters(model.get());
  }
  std::vector<DTensor*> grads;
  std::vector<AdamWParam> adam_params;
  for (fsdp::ShardedParameter* sp : params) {
    grads.push_back(&sp->grad);
    adam_params.emplace_back(sp->name, &sp->master, &sp->grad,
                             /*weight_decay=*/sp->shape.size() >= 2);
    result->rank_params += sp->master.local().numel();
    result->param_bytes += sp->master.local().nbytes();
    result->grad_bytes += sp->grad.local().nbytes();
  }
  ASSIGN_OR_RETURN(AdamW adamw, AdamW::Create(std::move(adam_params), {}));
  RETURN_IF_ERROR(adamw.Init());
  ASSIGN_OR_RETURN(OptimizerStateDict osd, adamw.StateDict());
  for (const auto& [name, t] : osd.tensors) {
    result->optimizer_bytes += t.local().nbytes();
  }
  result->after_setup = acct->Stats();
  if (host_acct != nullptr) result->host_after_setup = host_acct->Stats();
  phases.End("setup");

  // The steps: the trainer's order (trainer.cc TrainStep). Two of them: the
  // first records the units' order, from which the later ones prefetch
  // (holding one more all-gather buffer), so the second is the steady
  // state. The ops logged are the second step's.
  const Shape batch{strategy.micro_batch, strategy.seq(config)};
  for (int step = 1; step <= 2; ++step) {
    const std::string prefix = absl::StrCat("step ", step, " ");
    if (log != nullptr) log->Clear();
    const int64_t allocations_before = acct->Stats().total_allocations;
    const absl::Time step_start = absl::Now();
    phases.Begin();
    RETURN_IF_ERROR(ZeroGrad(grads));
    if (runner != nullptr) {
      // The pipeline runs every micro-batch (how many are in flight at once
      // is the schedule's): trainer.cc PipelineForwardBackward.
      std::vector<Tensor> ids, targets;
      for (int64_t m = 0; m < strategy.grad_accumulation; ++m) {
        ASSIGN_OR_RETURN(Tensor i, Tensor::Zeros(batch, DType::kI32, device));
        ASSIGN_OR_RETURN(Tensor t, Tensor::Zeros(batch, DType::kI32, device));
        ids.push_back(std::move(i));
        targets.push_back(std::move(t));
      }
      for (fsdp::FsdpUnit* u : stages.units) u->SetRequiresGradientSync(false);
      RETURN_IF_ERROR(
          runner
              ->Step(ids, targets,
                     1.0f / static_cast<float>(strategy.grad_accumulation))
              .status());
      RETURN_IF_ERROR(parallel::SumSharedGradients(
          pp_group, runner->schedule(), stages.tied_first, stages.tied_last,
          absl::Minutes(30)));
      phases.End(absl::StrCat(prefix, "pipeline"));
      phases.Begin();
      if (log != nullptr) {
        log->Add({"all_reduce", "train/pp", strategy.pp, 8, 8});  // the loss
      }
    }
    // Micro-batches after the second repeat its allocations and collectives
    // exactly (the same shapes into the same buffers): two are run, and the
    // others' tensors and collectives are counted as the second's. With HSDP
    // the last one differs (the replicas' all-reduce, trainer.cc
    // ForwardBackward): three are run, and the middle one is repeated.
    const int64_t accumulation = strategy.grad_accumulation;
    const int64_t run_micro =
        runner != nullptr
            ? 0
            : std::min<int64_t>(accumulation,
                                strategy.dp_replicate > 1 ? 3 : 2);
    const int64_t repeated = std::min<int64_t>(run_micro, 2);
    int64_t allocations_at_repeated = 0, repeated_allocations_each = 0;
    size_t ops_at_repeated = 0, ops_after_repeated = 0;
    for (int64_t m = 1; m <= run_micro; ++m) {
      const bool last = m == run_micro;
      for (fsdp::FsdpUnit* u : units) u->SetRequiresAllReduce(last);
      if (m == repeated) {
        allocations_at_repeated = acct->Stats().total_allocations;
        ops_at_repeated = log != nullptr ? log->ops().size() : 0;
      }
      // The loader's batch: int32 ids and targets (token 0 on a real device).
      ASSIGN_OR_RETURN(Tensor ids, Tensor::Zeros(batch, DType::kI32, device));
      ASSIGN_OR_RETURN(Tensor targets,
                       Tensor::Zeros(batch, DType::kI32, device));
      RETURN_IF_ERROR(model->ForwardLoss(ids, targets).status());
      phases.End(absl::StrCat(prefix, "forward ", m));
      phases.Begin();
      RETURN_IF_ERROR(model->Backward(1.0f / static_cast<float>(accumulation)));
      phases.End(absl::StrCat(prefix, "backward ", m));
      phases.Begin();
      if (m == repeated) {
        repeated_allocations_each =
            acct->Stats().total_allocations - allocations_at_repeated;
        ops_after_repeated = log != nullptr ? log->ops().size() : 0;
      }
    }
    const int64_t repeats = runner != nullptr ? 0 : accumulation - run_micro;
    const int64_t repeated_allocations = repeats * repeated_allocations_each;
    if (log != nullptr && repeats > 0) {
      const std::vector<SimulatedOp> ops = log->ops();
      for (int64_t r = 0; r < repeats; ++r) {
        for (size_t i = ops_at_repeated; i < ops_after_repeated; ++i) {
          log->Add(ops[i]);
        }
      }
    }
    // The gradient norm reads the gradients' values, which meta tensors do not
    // have: it is not run (its memory is one double per rank). Its
    // collective, one scalar all-reduce over the axis the gradients are
    // sharded on, is logged, with the trainer's all-reduce of the step's loss
    // over the world before it (trainer.cc TrainStep).
    if (log != nullptr) {
      if (strategy.world > 1) {
        log->Add({"all_reduce", "train", strategy.world, 8, 8});
      }
      if (strategy.dp_shard() > 1) {
        log->Add({"all_reduce", "train/shard", strategy.dp_shard(), 8, 8});
      }
      if (strategy.tp > 1) {
        log->Add({"all_reduce", "train/tp", strategy.tp, 8, 8});
      }
      if (strategy.pp > 1) {  // the stages' totals added up
        log->Add({"all_reduce", "train/pp", strategy.pp, 8, 8});
      }
    }
    RETURN_IF_ERROR(adamw.Step(1.0f));
    phases.End(absl::StrCat(prefix, "optimizer"));
    result->step_allocations = acct->Stats().total_allocations -
                               allocations_before + repeated_allocations;
    result->step_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
  }
  if (log != nullptr) result->ops = log->ops();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DryRunResult> DryRun(const models::TransformerConfig& config,
                                    const Strategy& strategy, int rank,
                                    bool separate_host,
                                    SimulatedBackend backend) {
  RETURN_IF_ERROR(CheckStrategy(config, strategy));
  if (rank < 0 || rank >= strategy.world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan: rank ", rank, " is not in a world of ", strategy.world));
  }
  // One dry run at a time in a process: the dry-run devices' accountants
  // are process-wide (thread ranks of one process plan concurrently).
  static absl::Mutex* const mu = new absl::Mutex;
  absl::MutexLock lock(mu);
  // Declared first: it must outlive every meta tensor of the run.
  MetaAccountant accountant(Device::DryRun());
  MetaAccountant host_accountant(Device::DryRunHost());
  SimulatedOpLog log;
  DryRunResult result;
  {
    ScopedMetaAccounting accounting(&accountant);
    // The host is counted apart only when it is a memory of its own
    // (StagingHost looks for this accountant).
    std::optional<ScopedMetaAccounting> host_accounting;
    if (separate_host) host_accounting.emplace(&host_accountant);
    RETURN_IF_ERROR(
        Step(config, strategy, rank, SimulatedGroupFactory(&log, backend),
             Device::DryRun(),
             separate_host ? Device::DryRunHost() : Device::DryRun(), &log,
             &result));
  }
  return result;
}

absl::StatusOr<DryRunResult> RunStepOn(const models::TransformerConfig& config,
                                       const Strategy& strategy, int rank,
                                       ProcessGroupFactory factory,
                                       Device device) {
  RETURN_IF_ERROR(CheckStrategy(config, strategy));
  DryRunResult result;
  RETURN_IF_ERROR(Step(config, strategy, rank, std::move(factory), device,
                       device, nullptr, &result));
  return result;
}

}  // namespace plan
}  // namespace fsdpp
