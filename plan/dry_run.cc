// DryRun; see dry_run.h.
#include "plan/dry_run.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "mesh/device_mesh.h"
#include "optim/adamw.h"
#include "recipe/step/step.h"
#include "recipe/training.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace plan {
namespace {

// Watches the recipe's steps: each phase's memory (the allocators' live
// bytes at its end and its peak) and the micro-batches that really run. Of
// a step's micro-batches it runs the first two (three with HSDP, whose last
// one all-reduces over the replicas), records the allocations and
// collectives of the second (the one repeated) and counts the others as
// copies of it.
class Recorder final : public recipe::StepObserver {
 public:
  Recorder(Allocator* device, Allocator* host, SimulatedOpLog* log, bool hsdp,
           DryRunResult* result)
      : device_(device), host_(host), log_(log), hsdp_(hsdp), result_(result) {}

  // Starts a phase: the peaks restart.
  void Begin() {
    device_->ResetPeak();
    if (host_ != nullptr) host_->ResetPeak();
  }
  // Ends the phase `name` (with the current step's prefix).
  void End(const std::string& name) {
    PhaseMemory phase{prefix_ + name, device_->Stats(), {}};
    if (phase.stats.total_peak > result_->peak_bytes) {
      result_->peak_bytes = phase.stats.total_peak;
      result_->peak_phase = phase.name;
    }
    if (host_ != nullptr) {
      phase.host = host_->Stats();
      result_->host_peak_bytes =
          std::max(result_->host_peak_bytes, phase.host.total_peak);
    }
    result_->phases.push_back(std::move(phase));
  }
  void StartStep(int step) {
    prefix_ = absl::StrCat("step ", step, " ");
    repeated_allocations_ = 0;
    if (log_ != nullptr) log_->Clear();
    Begin();
  }
  // The allocations the step's uncounted micro-batches would have made.
  int64_t repeated_allocations() const { return repeated_allocations_; }

  int64_t MicroBatchesToRun(int64_t micro_batches) override {
    micro_batches_ = micro_batches;
    return std::min<int64_t>(micro_batches, hsdp_ ? 3 : 2);
  }
  void MicroBatchBegins(int64_t index, int64_t run) override {
    if (index != Repeated(run)) return;
    allocations_at_ = device_->Stats().total_allocations;
    ops_at_ = log_ != nullptr ? log_->ops().size() : 0;
  }
  void MicroBatchEnded(int64_t index, int64_t run) override {
    if (index == Repeated(run)) {
      allocations_each_ = device_->Stats().total_allocations - allocations_at_;
      ops_end_ = log_ != nullptr ? log_->ops().size() : 0;
    }
    if (index + 1 != run) return;
    const int64_t repeats = micro_batches_ - run;
    repeated_allocations_ = repeats * allocations_each_;
    if (log_ == nullptr) return;
    const std::vector<SimulatedOp> ops = log_->ops();
    for (int64_t r = 0; r < repeats; ++r) {
      for (size_t i = ops_at_; i < ops_end_; ++i) log_->Add(ops[i]);
    }
  }
  void PhaseEnded(absl::string_view phase) override {
    End(std::string(phase));
    Begin();
  }

 private:
  // The micro-batch later ones repeat: the second (of the ones run).
  static int64_t Repeated(int64_t run) { return std::min<int64_t>(run, 2) - 1; }

  Allocator* device_;
  Allocator* host_;
  SimulatedOpLog* log_;
  bool hsdp_;
  DryRunResult* result_;
  std::string prefix_;
  int64_t micro_batches_ = 0;
  int64_t allocations_at_ = 0, allocations_each_ = 0;
  int64_t repeated_allocations_ = 0;
  size_t ops_at_ = 0, ops_end_ = 0;
};

// The sharded state's sizes and the setup's memory.
absl::Status RecordSetup(recipe::Training& training,
                         const models::TransformerConfig& config,
                         Allocator* device, Allocator* host,
                         DryRunResult* result) {
  // The whole model as the layout builds it (LoRA's adapters included).
  FSDPP_ASSIGN_OR_RETURN(const recipe::Layout::ParameterCounts counts,
                         training.layout().CountParameters(config));
  result->model_params = counts.total;
  for (fsdp::ShardedParameter* sp : training.params()) {
    result->rank_params += sp->master.local().numel();
    result->param_bytes += sp->master.local().nbytes();
    if (sp->requires_grad) result->grad_bytes += sp->grad.local().nbytes();
  }
  FSDPP_ASSIGN_OR_RETURN(OptimizerStateDict osd,
                         training.optimizer().StateDict());
  for (const auto& [name, t] : osd.tensors) {
    result->optimizer_bytes += t.local().nbytes();
  }
  result->pipeline_bubble = training.schedule_bubble();
  result->after_setup = device->Stats();
  if (host != nullptr) result->host_after_setup = host->Stats();
  return absl::OkStatus();
}

// Builds the recipe on `device` and runs two of its steps, recording into
// `result` (and `log`, when the groups are simulated).
absl::Status Step(const models::TransformerConfig& config,
                  const recipe::Layout& layout, int rank,
                  ProcessGroupFactory factory, ProcessGroupFactory host_factory,
                  Device device, Device host, bool gpu, SimulatedOpLog* log,
                  DryRunResult* result) {
  Allocator* acct = GetAllocator(device);
  Allocator* host_acct = host == device ? nullptr : GetAllocator(host);
  if (acct == nullptr || (host != device && host_acct == nullptr)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "plan: no allocator for ", device.ToString(), " or ", host.ToString()));
  }
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceMesh> mesh,
      DeviceMesh::Create(layout.MeshAxes(), rank, layout.world,
                         std::move(factory), "train"));
  std::unique_ptr<DeviceMesh> host_mesh;
  if (host_factory) {
    FSDPP_ASSIGN_OR_RETURN(
        host_mesh, DeviceMesh::Create(layout.MeshAxes(), rank, layout.world,
                                      std::move(host_factory), "host"));
  }
  Recorder recorder(acct, host_acct, log, layout.dp_replicate > 1, result);
  recorder.Begin();
  recipe::BuildOptions options;
  options.host = host;
  options.host_mesh = host_mesh.get();
  // As the trainer builds it on a GPU: the step's values stay there.
  options.step_values_on_device = gpu;
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<recipe::Training> training,
      recipe::Training::Build(config, layout, mesh.get(), options));
  FSDPP_RETURN_IF_ERROR(
      RecordSetup(*training, config, acct, host_acct, result));
  recorder.End("setup");
  // The loader's batches: int32 ids and targets (token 0 on a real device).
  const Shape batch{layout.micro_batch, layout.seq(config)};
  const recipe::MicroBatchSource zeros =
      [&](int64_t) -> absl::StatusOr<recipe::MicroBatch> {
    recipe::MicroBatch b;
    FSDPP_ASSIGN_OR_RETURN(b.ids, Tensor::Zeros(batch, DType::kI32, device));
    FSDPP_ASSIGN_OR_RETURN(b.targets,
                           Tensor::Zeros(batch, DType::kI32, device));
    return b;
  };
  // Two steps: the first records the units' order, from which the later
  // ones prefetch (holding one more all-gather buffer), so the second is the
  // steady state. The ops logged are the second step's.
  for (int step = 1; step <= 2; ++step) {
    recorder.StartStep(step);
    const int64_t allocations_before = acct->Stats().total_allocations;
    const absl::Time start = absl::Now();
    FSDPP_RETURN_IF_ERROR(
        training->ForwardBackward(zeros, 1.0, &recorder).status());
    recipe::OptimizerStepOptions optimizer;
    optimizer.lr = 1e-4;
    FSDPP_RETURN_IF_ERROR(
        training->OptimizerStep(optimizer, &recorder).status());
    result->step_allocations = acct->Stats().total_allocations -
                               allocations_before +
                               recorder.repeated_allocations();
    result->step_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  }
  if (log != nullptr) result->ops = log->ops();
  return absl::OkStatus();
}

absl::Status CheckRank(const recipe::Layout& layout, int rank) {
  if (rank < 0 || rank >= layout.world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan: rank ", rank, " is not in a world of ", layout.world));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DryRunResult> DryRun(const models::TransformerConfig& config,
                                    const recipe::Layout& layout, int rank,
                                    bool separate_host,
                                    SimulatedBackend backend) {
  FSDPP_RETURN_IF_ERROR(layout.Validate(config));
  FSDPP_RETURN_IF_ERROR(CheckRank(layout, rank));
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
    FSDPP_RETURN_IF_ERROR(
        Step(config, layout, rank, SimulatedGroupFactory(&log, backend), {},
             Device::DryRun(),
             separate_host ? Device::DryRunHost() : Device::DryRun(),
             /*gpu=*/backend == SimulatedBackend::kNccl, &log, &result));
  }
  return result;
}

absl::StatusOr<DryRunResult> RunStepOn(const models::TransformerConfig& config,
                                       const recipe::Layout& layout, int rank,
                                       ProcessGroupFactory factory,
                                       Device device,
                                       ProcessGroupFactory host_factory) {
  FSDPP_RETURN_IF_ERROR(layout.Validate(config));
  FSDPP_RETURN_IF_ERROR(CheckRank(layout, rank));
  DryRunResult result;
  FSDPP_RETURN_IF_ERROR(Step(config, layout, rank, std::move(factory),
                             std::move(host_factory), device, device,
                             /*gpu=*/device.is_cuda(), nullptr, &result));
  return result;
}

}  // namespace plan
}  // namespace fsdpp
