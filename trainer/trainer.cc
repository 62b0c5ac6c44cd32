#include "trainer/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/reader.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/training/training_state.h"
#include "comm/host_collectives.h"
#include "core/device_wait.h"
#include "core/gpus.h"
#include "core/logging.h"
#include "core/memcpy.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/trace.h"
#include "formats/file_util.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/hf_directory.h"
#include "models/lora.h"
#include "models/parallelize/hf_import.h"
#include "models/transformer.h"
#include "nn/moe.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "optim/lr_schedule.h"
#include "plan/planner.h"
#include "plan/rates.h"
#include "recipe/step/step.h"
#include "recipe/training.h"
#include "runtime/launch.h"
#include "tensor/cpu/onednn_matmul.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "trainer/config.h"
#include "trainer/data/loader.h"
#include "trainer/metrics.h"

namespace fsdpp {
namespace trainer {
namespace {

// The checkpoint key of the job that saved it (TrainerEnv::job_id).
constexpr char kJobKey[] = "train/job";

// `value`, or its error with `context` in front.
template <typename T>
absl::StatusOr<T> Context(absl::StatusOr<T> value, absl::string_view context) {
  if (!value.ok()) return Annotate(value.status(), context);
  return value;
}

// The unigram baseline is estimated on at most this many tokens.
constexpr int64_t kUnigramTokens = 16 << 20;
// Matmul size and time budget of the CPU peak measurement.
constexpr int64_t kPeakMatmulN = 1024;
constexpr absl::Duration kPeakBudget = absl::Milliseconds(600);

absl::StatusOr<LrDecay> ParseDecay(const std::string& name) {
  if (name == "cosine") return LrDecay::kCosine;
  if (name == "linear") return LrDecay::kLinear;
  if (name == "constant") return LrDecay::kConstant;
  return absl::InvalidArgumentError(
      absl::StrCat("training.schedule: unknown \"", name, "\""));
}

// Every rank's allocator statistics (current and peak per tag, totals).
absl::StatusOr<std::vector<MemoryStats>> GatherMemory(ProcessGroup* group,
                                                      Device device) {
  const MemoryStats mine = GetAllocator(device)->Stats();
  std::vector<int64_t> v;
  for (int t = 0; t < kNumMemoryTags; ++t) v.push_back(mine.current[t]);
  for (int t = 0; t < kNumMemoryTags; ++t) v.push_back(mine.peak[t]);
  v.push_back(mine.total_current);
  v.push_back(mine.total_peak);
  v.push_back(mine.reserved_bytes);
  const size_t n = v.size();
  FSDPP_ASSIGN_OR_RETURN(std::vector<int64_t> all, AllGatherInts(group, v));
  std::vector<MemoryStats> stats(group->size());
  for (int r = 0; r < group->size(); ++r) {
    const int64_t* p = all.data() + r * n;
    for (int t = 0; t < kNumMemoryTags; ++t) {
      stats[r].current[t] = p[t];
      stats[r].peak[t] = p[kNumMemoryTags + t];
    }
    stats[r].total_current = p[2 * kNumMemoryTags];
    stats[r].total_peak = p[2 * kNumMemoryTags + 1];
    stats[r].reserved_bytes = p[2 * kNumMemoryTags + 2];
  }
  return stats;
}

// The batch's ids and targets as i32 [batch, seq] tensors on `device`. On a
// GPU each is range-checked here, on the host (so the GPU's ops skip their
// own check, a device-to-host copy), then copied without waiting for the GPU
// (pinned staging, core/memcpy.h).
absl::StatusOr<recipe::MicroBatch> BatchTensors(const Batch& batch,
                                                Device device) {
  const Shape shape{batch.batch_size, batch.seq_len};
  recipe::MicroBatch host;
  FSDPP_ASSIGN_OR_RETURN(host.ids,
                         Tensor::Empty(shape, DType::kI32, Device::Cpu()));
  FSDPP_ASSIGN_OR_RETURN(host.targets,
                         Tensor::Empty(shape, DType::kI32, Device::Cpu()));
  std::copy(batch.inputs.begin(), batch.inputs.end(), host.ids.data<int32_t>());
  std::copy(batch.targets.begin(), batch.targets.end(),
            host.targets.data<int32_t>());
  // Each row's sample, for dropout's masks: its epoch and window.
  for (int64_t r = 0; r < batch.batch_size; ++r) {
    host.row_keys.push_back((static_cast<uint64_t>(batch.epochs[r]) << 40) |
                            static_cast<uint64_t>(batch.windows[r]));
  }
  if (device.is_cpu()) return host;
  recipe::MicroBatch out;
  out.row_keys = host.row_keys;
  FSDPP_ASSIGN_OR_RETURN(out.ids, Tensor::Empty(shape, DType::kI32, device));
  FSDPP_ASSIGN_OR_RETURN(out.targets,
                         Tensor::Empty(shape, DType::kI32, device));
  for (auto [src, dst] :
       {std::pair{&host.ids, &out.ids}, {&host.targets, &out.targets}}) {
    const int32_t* ids = src->data<int32_t>();
    const auto [lo, hi] = std::minmax_element(ids, ids + src->numel());
    FSDPP_RETURN_IF_ERROR(CopyBytesFromHostAsync(
        dst->raw_data(), device, src->raw_data(), src->nbytes()));
    // Negative ids (SFT's ignored targets) keep the GPU's own check.
    if (src->numel() > 0 && *lo >= 0)
      dst->MarkIdsCheckedBelow(*hi + int64_t{1});
  }
  return out;
}

// The loader's next batches, one per micro-batch the step (or evaluation)
// of `micro_batches` asks for. With a loss mask (SFT data) each carries the
// step's count of trained targets over every rank (read from the loader
// before the first), so that the loss is the token mean over the global
// batch.
recipe::MicroBatchSource LoaderBatches(DataLoader* loader, Device device,
                                       int64_t micro_batches) {
  auto tokens = std::make_shared<int64_t>(-1);
  return [loader, device, micro_batches,
          tokens](int64_t m) -> absl::StatusOr<recipe::MicroBatch> {
    if (m == 0 && loader->masked()) {
      *tokens = loader->LossTargetsAhead(micro_batches);
    }
    FSDPP_ASSIGN_OR_RETURN(recipe::MicroBatch batch,
                           BatchTensors(loader->Next(), device));
    batch.step_loss_tokens = *tokens;
    return batch;
  };
}

// `pending`: the step's loss and norm are still on the device (shown as
// "..." until a logged step reads them).
std::string TrainLine(const StepLog& s, bool pending, int64_t steps,
                      double tokens_per_s, double mfu, double eta_s) {
  return absl::StrFormat(
      "step %*d/%d | loss %s | lr %.2e | gnorm %s | %s tok/s | MFU %.2f%% "
      "| %.0f ms/step | ETA %s",
      static_cast<int>(absl::StrCat(steps).size()), s.step, steps,
      pending ? std::string("...") : absl::StrFormat("%.4f", s.loss), s.lr,
      pending ? std::string("...") : absl::StrFormat("%.3f", s.grad_norm),
      absl::StrFormat("%.0f", tokens_per_s), 100.0 * mfu, 1000.0 * s.step_s,
      FormatEta(eta_s));
}

}  // namespace

// Rank 0's printer.
class Trainer::Printer {
 public:
  explicit Printer(const TrainerEnv& env) : env_(env) {}
  bool active() const { return env_.rank == 0 && env_.out != nullptr; }
  void Line(const std::string& text) {
    if (!active()) return;
    ClearProgress();
    std::fputs(text.c_str(), env_.out);
    if (text.empty() || text.back() != '\n') std::fputc('\n', env_.out);
    std::fflush(env_.out);
  }
  // A progress line: redrawn in place on a terminal or as a launcher status
  // line every step (and kept when `keep`); otherwise printed only when
  // `keep`.
  void Progress(const std::string& text, bool keep) {
    if (!active()) return;
    switch (env_.progress) {
      case TrainerEnv::Progress::kTerminal:
        std::fprintf(env_.out, "\r%s\033[K", text.c_str());
        progress_shown_ = !keep;
        if (keep) std::fputc('\n', env_.out);
        break;
      case TrainerEnv::Progress::kStatusLines:
        std::fprintf(env_.out, keep ? "%s\n" : "\r%s\n", text.c_str());
        break;
      case TrainerEnv::Progress::kLines:
        if (keep) std::fprintf(env_.out, "%s\n", text.c_str());
        break;
    }
    std::fflush(env_.out);
  }

 private:
  void ClearProgress() {
    if (progress_shown_) std::fputs("\r\033[K", env_.out);
    progress_shown_ = false;
  }
  const TrainerEnv& env_;
  bool progress_shown_ = false;
};

Trainer::Trainer(const TrainConfig& config, const TrainerEnv& env,
                 ResolvedTrainConfig rc)
    : config_(config),
      env_(env),
      rc_(std::move(rc)),
      print_(std::make_unique<Printer>(env_)) {}

Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const TrainConfig& config, const TrainerEnv& env) {
  FSDPP_ASSIGN_OR_RETURN(ResolvedTrainConfig rc,
                         ResolveTrainConfig(config, env.world_size));
  // (The planner plans such a run for a GPU; the trainer cannot run it.)
  if (rc.model.moe.enabled() && config.training().device() == "cuda") {
    return absl::UnimplementedError(absl::StrCat(
        "trainer: model ", rc.model.name,
        " has a mixture of experts, which runs on the CPU only for now (its "
        "routing is host code): set training.device to cpu"));
  }
  if ((config.training().device() == "cuda") != env.device.is_cuda()) {
    return absl::FailedPreconditionError(
        absl::StrCat("trainer: training.device is ", config.training().device(),
                     " but this rank was given ", env.device.ToString(),
                     " (train_main gives rank r cuda:LOCAL_RANK)"));
  }
  std::unique_ptr<Trainer> trainer(new Trainer(config, env, std::move(rc)));
  FSDPP_RETURN_IF_ERROR(trainer->CheckMemoryPlan());
  FSDPP_RETURN_IF_ERROR(trainer->BuildMesh());
  FSDPP_RETURN_IF_ERROR(trainer->BuildData());
  FSDPP_RETURN_IF_ERROR(trainer->BuildModel());
  trainer->ReportMemory("model built (masters and gradients allocated)");
  FSDPP_RETURN_IF_ERROR(trainer->BuildOptimizer());
  FSDPP_RETURN_IF_ERROR(trainer->BuildCheckpointState());
  FSDPP_RETURN_IF_ERROR(trainer->BuildCheckpointWriter());
  FSDPP_RETURN_IF_ERROR(trainer->BuildMetrics());
  trainer->run_start_ = absl::Now();
  trainer->ReportMemory("set up (sharded state allocated)");
  return trainer;
}

// Before anything is allocated or written: the run's plan (its training
// steps dry-run on meta tensors, plan/) against the memory a rank may use,
// so that a run that cannot fit fails now with what to change, not later in
// the kernel's out-of-memory killer. Every rank plans the largest rank's
// share (plan::kLargestRank), so all decide alike without communicating.
absl::Status Trainer::CheckMemoryPlan() {
  int ranks_per_node = env_.world_size;
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE")) {
    int n = 0;
    if (absl::SimpleAtoi(local, &n) && n > 0) ranks_per_node = n;
  }
  // The planner's device: this CPU, or a GPU it has a data sheet for.
  std::string planned_device = "cpu";
  if (env_.device.is_cuda()) {
    FSDPP_ASSIGN_OR_RETURN(const std::string name,
                           GpuName(env_.device.index()));
    planned_device = absl::StrContains(name, "H200")   ? "h200"
                     : absl::StrContains(name, "H100") ? "h100"
                                                       : "";
    if (planned_device.empty()) {
      plan_note_ = absl::StrCat("  memory plan: none (no data sheet for ", name,
                                "; tools/plan knows h100, h200)");
      return absl::OkStatus();
    }
  }
  FSDPP_ASSIGN_OR_RETURN(
      plan::DeviceSpec device,
      plan::DeviceByName(
          planned_device, ranks_per_node, /*calibrate=*/false,
          UsesSharedMemory(config_, ranks_per_node, env_.world_size)));
  const TrainingConfig& tc = config_.training();
  if (tc.max_memory_gib() > 0) {
    device.memory_bytes =
        static_cast<int64_t>(tc.max_memory_gib() * 1024.0 * 1024.0 * 1024.0);
  }
  const absl::Time t0 = absl::Now();
  FSDPP_ASSIGN_OR_RETURN(plan::Plan p,
                         Context(plan::MakePlan(rc_.model, rc_.layout, device),
                                 "trainer: planning the run's memory"));
  plan_peak_bytes_ = p.run.peak_bytes;
  plan_summary_ =
      absl::StrFormat("the plan: peak %s in %s + %s overhead = %s, against %s",
                      plan::FormatBytes(p.run.peak_bytes), p.run.peak_phase,
                      plan::FormatBytes(device.overhead_bytes),
                      plan::FormatBytes(p.predicted_peak_bytes),
                      plan::FormatBytes(device.memory_bytes));
  ReportMemory("planned, nothing allocated yet");
  plan_note_ = absl::StrFormat(
      "  memory plan: peak %s per rank in %s (largest: %s) + %s overhead = "
      "%s of %s%s (planned in %.0f ms)",
      plan::FormatBytes(p.run.peak_bytes), p.run.peak_phase, p.largest,
      plan::FormatBytes(device.overhead_bytes),
      plan::FormatBytes(p.predicted_peak_bytes),
      plan::FormatBytes(device.memory_bytes),
      tc.max_memory_gib() > 0 ? " (training.max_memory_gib)" : "",
      absl::ToDoubleMilliseconds(absl::Now() - t0));
  if (p.fits) return absl::OkStatus();
  if (tc.skip_memory_check()) {
    absl::StrAppend(&plan_note_,
                    ": DOES NOT FIT, running anyway "
                    "(training.skip_memory_check)");
    return absl::OkStatus();
  }
  FSDPP_ASSIGN_OR_RETURN(std::vector<plan::Candidate> alternatives,
                         plan::SearchStrategies(rc_.model, rc_.layout, device));
  return absl::ResourceExhaustedError(absl::StrCat(
      "trainer: ", config_.model().name(), " on ", env_.world_size,
      " rank(s): ", plan::ExplainDoesNotFit(p, alternatives),
      " Set training.max_memory_gib to plan for another budget, or "
      "training.skip_memory_check=true to run anyway."));
}

// Under a launcher (runtime/launch.h kMemoryReportEnv): this rank's memory
// now, in one line the launcher quotes if the rank is killed for memory.
void Trainer::ReportMemory(const std::string& when) const {
  const char* path = std::getenv(launch::kMemoryReportEnv);
  if (path == nullptr || *path == '\0') return;
  const MemoryStats m = GetAllocator(env_.device)->Stats();
  std::ofstream f(path, std::ios::trunc);
  f << absl::StrFormat("%s: %s live, peak %s, %s held%s%s\n", when,
                       plan::FormatBytes(m.total_current),
                       plan::FormatBytes(m.total_peak),
                       plan::FormatBytes(m.reserved_bytes),
                       plan_summary_.empty() ? "" : "; ", plan_summary_);
}

// The layout's mesh ([pp,] [replicate,] shard [, tp]); the trace recorder.
absl::Status Trainer::BuildMesh() {
  FSDPP_ASSIGN_OR_RETURN(
      mesh_,
      Context(DeviceMesh::Create(rc_.layout.MeshAxes(), env_.rank,
                                 env_.world_size, env_.group_factory, "train"),
              "trainer: creating the device mesh"));
  if (env_.host_group_factory) {
    FSDPP_ASSIGN_OR_RETURN(
        host_mesh_, Context(DeviceMesh::Create(rc_.layout.MeshAxes(), env_.rank,
                                               env_.world_size,
                                               env_.host_group_factory, "host"),
                            "trainer: creating the host mesh"));
  }
  FSDPP_ASSIGN_OR_RETURN(
      world_, (host_mesh_ != nullptr ? host_mesh_ : mesh_)->FlatGroup());
  trace_ = std::make_unique<TraceRecorder>(env_.rank,
                                           absl::StrCat("rank ", env_.rank));
  trace_scope_.emplace(trace_.get());
  return absl::OkStatus();
}

// Data: the dataset, the unigram baseline, the loaders.
absl::Status Trainer::BuildData() {
  const TrainingConfig& tc = config_.training();
  FSDPP_ASSIGN_OR_RETURN(
      data_, Context(LoadDataset(config_.data()), "trainer: loading the data"));
  result_.unigram_loss = UnigramLoss(
      *data_.tokens, data_.train.begin,
      std::min(data_.train.end, data_.train.begin + kUnigramTokens));
  LoaderOptions train_options;
  train_options.seq_len = rc_.layout.seq_len;
  train_options.batch_size = rc_.layout.micro_batch;
  // The data-parallel rank: this rank's place on the replicate and shard
  // axes (the tp ranks, the pipeline stages and the cp ranks of one
  // data-parallel rank read the same batches).
  FSDPP_ASSIGN_OR_RETURN(DeviceMesh * data_mesh,
                         mesh_->SubMesh(rc_.layout.DataAxes()));
  train_options.dp_rank = rc_.layout.DataRank(data_mesh->rank());
  train_options.dp_world = rc_.layout.data_parallel();
  train_options.seed = tc.seed();
  train_options.shuffle = config_.data().shuffle();
  FSDPP_ASSIGN_OR_RETURN(loader_,
                         Context(MakeLoader(data_, data_.train, train_options),
                                 "trainer: the training split"));
  const ValidationConfig& vc = config_.validation();
  if (vc.interval() > 0 && data_.validation.size() > 0) {
    LoaderOptions validation_options = train_options;
    validation_options.shuffle = false;
    FSDPP_ASSIGN_OR_RETURN(
        val_loader_,
        Context(MakeLoader(data_, data_.validation, validation_options),
                "trainer: the validation split"));
  }
  return absl::OkStatus();
}

// The recipe's build: meta model -> plans -> sharded init -> AdamW.
absl::Status Trainer::BuildModel() {
  const TrainingConfig& tc = config_.training();
  recipe::BuildOptions options;
  options.seed = tc.seed();
  options.timeout = rc_.comm_timeout;
  options.adamw.lr = tc.lr();
  options.adamw.beta1 = tc.adam_beta1();
  options.adamw.beta2 = tc.adam_beta2();
  options.adamw.eps = tc.adam_eps();
  options.adamw.weight_decay = tc.weight_decay();
  options.host_mesh = host_mesh_.get();
  options.step_values_on_device =
      env_.step_values_on_device.value_or(env_.device.is_cuda());
  FSDPP_ASSIGN_OR_RETURN(training_,
                         Context(recipe::Training::Build(rc_.model, rc_.layout,
                                                         mesh_.get(), options),
                                 "trainer: building the model"));
  result_.pipeline_bubble_schedule = training_->schedule_bubble();
  data_group_ = training_->data_group();
  FSDPP_ASSIGN_OR_RETURN(counts_, rc_.layout.CountParameters(rc_.model));
  frozen_.names = counts_.frozen_names;
  if (!frozen_.names.empty()) frozen_.source = FrozenSource();
  return InitFromHf();
}

absl::Status Trainer::InitFromHf() {
  FSDPP_RETURN_IF_ERROR(InitFromHfBase());
  if (!config_.model().lora().has_init_from()) return absl::OkStatus();
  const std::string& dir = config_.model().lora().init_from();
  models::HfShardedImportStats total;
  for (models::Transformer* model : training_->models()) {
    FSDPP_ASSIGN_OR_RETURN(
        models::HfShardedImportStats stats,
        Context(models::ImportPeftAdapterSharded(dir, rc_.layout.lora, model),
                "trainer: model.lora.init_from"));
    total.tensors += stats.tensors;
  }
  absl::StrAppend(&init_note_, init_note_.empty() ? "" : "; ",
                  "LoRA adapters initialised from ", dir, " (", total.tensors,
                  " tensors)");
  return absl::OkStatus();
}

absl::Status Trainer::InitFromHfBase() {
  if (!config_.model().has_init_from()) return absl::OkStatus();
  const std::string path = config_.model().init_from().substr(3);
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<models::HfDirectory> dir,
      Context(models::HfDirectory::Open(path), "trainer: model.init_from"));
  models::HfShardedImportStats total;
  for (models::Transformer* model : training_->models()) {
    FSDPP_ASSIGN_OR_RETURN(models::HfShardedImportStats stats,
                           Context(models::ImportHfSharded(*dir, model),
                                   "trainer: model.init_from"));
    total.tensors += stats.tensors;
    total.bytes_read += stats.bytes_read;
    total.largest_buffer_bytes =
        std::max(total.largest_buffer_bytes, stats.largest_buffer_bytes);
  }
  init_note_ = absl::StrFormat(
      "initialised from %s: %d tensors in %d file(s), %.2f MiB read by "
      "this rank%s (largest buffer %.2f MiB)",
      config_.model().init_from(), total.tensors, dir->files().size(),
      total.bytes_read / 1048576.0,
      training_->models().size() > 1 ? " for its model parts" : "",
      total.largest_buffer_bytes / 1048576.0);
  return absl::OkStatus();
}

// The loss scaler (f16) and the LR schedule.
absl::Status Trainer::BuildOptimizer() {
  const TrainingConfig& tc = config_.training();
  if (rc_.layout.param_dtype == DType::kF16) {
    LossScalerOptions scaler_options;
    scaler_options.init_scale = tc.initial_loss_scale();
    scaler_options.growth_interval = tc.loss_scale_growth_interval();
    FSDPP_ASSIGN_OR_RETURN(LossScaler created,
                           LossScaler::Create(scaler_options));
    scaler_.emplace(created);
  }
  LrScheduleOptions schedule_options;
  schedule_options.base_lr = tc.lr();
  schedule_options.warmup_steps = tc.warmup_steps();
  schedule_options.total_steps = tc.steps();
  schedule_options.min_lr_ratio = tc.min_lr_ratio();
  FSDPP_ASSIGN_OR_RETURN(schedule_options.decay, ParseDecay(tc.schedule()));
  FSDPP_ASSIGN_OR_RETURN(LrSchedule schedule,
                         LrSchedule::Create(schedule_options));
  schedule_.emplace(std::move(schedule));
  return absl::OkStatus();
}

// Checkpoint state: views of the masters and the optimizer state, so loads
// write in place; then the resume from the latest checkpoint.
absl::Status Trainer::BuildCheckpointState() {
  // Frozen parameters are referenced, not saved: their source and names.
  FSDPP_ASSIGN_OR_RETURN(
      state_,
      ModelAndOptimizerState(training_->params(), training_->optimizer(),
                             FrozenMasters::kReference, frozen_.names));
  FSDPP_RETURN_IF_ERROR(state_.AddBytes(kFrozenKey, frozen_.ToString()));
  // The adapters' shape, for tools that rebuild the model (tools/ckpt
  // export --format=hf|peft); empty without LoRA.
  FSDPP_RETURN_IF_ERROR(state_.AddBytes(
      models::kLoraKey,
      rc_.layout.lora.enabled() ? models::LoraJson(rc_.layout.lora) : ""));
  FSDPP_RETURN_IF_ERROR(state_.AddBytes("train/step", "0"));
  FSDPP_RETURN_IF_ERROR(state_.AddBytes("train/loader", ""));
  FSDPP_RETURN_IF_ERROR(state_.AddBytes("train/loss_scaler", ""));
  FSDPP_RETURN_IF_ERROR(
      state_.AddBytes("train/config", FormatTrainConfig(config_)));
  // The resolved model config, for tools that rebuild the model from the
  // checkpoint alone (tools/ckpt export --format=hf).
  FSDPP_RETURN_IF_ERROR(state_.AddBytes(models::kModelConfigKey,
                                        models::ModelConfigJson(rc_.model)));
  // The job: rank 0's identity (the launcher's, else a new one) on every
  // rank.
  std::string job = env_.job_id;
  if (job.empty()) {
    std::random_device random;
    job = absl::StrFormat("%08x%08x", random(), random());
  }
  FSDPP_ASSIGN_OR_RETURN(std::vector<std::string> jobs,
                         AllGatherStrings(world_, job));
  job_ = jobs[0];
  FSDPP_RETURN_IF_ERROR(state_.AddBytes(kJobKey, job_));
  const CheckpointConfig& cc = config_.checkpoint();
  if (!cc.resume() && !cc.folder().empty()) return ResumeOwnCheckpoint();
  if (cc.resume() && !cc.folder().empty()) {
    absl::StatusOr<std::vector<CheckpointDir>> dirs =
        ScanCheckpoints(cc.folder());
    if (!dirs.ok() && !absl::IsNotFound(dirs.status())) return dirs.status();
    std::string latest;
    std::vector<std::string> skipped;
    for (const CheckpointDir& d :
         dirs.ok() ? *dirs : std::vector<CheckpointDir>{}) {
      if (d.committed) {
        latest = d.path;
        skipped.clear();  // only the ones newer than the latest matter
      } else {
        skipped.push_back(d.path);
      }
    }
    if (!skipped.empty()) {
      resume_notes_.push_back(absl::StrCat(
          "resume: skipped ", absl::StrJoin(skipped, ", "),
          ": no committed metadata (an interrupted copy or a damaged "
          "checkpoint)",
          latest.empty() ? "" : absl::StrCat("; using ", latest)));
    }
    if (latest.empty()) {
      if (cc.resume_required()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "trainer: checkpoint.resume_required, but ", cc.folder(),
            " holds no committed checkpoint",
            skipped.empty() ? "" : " (only uncommitted step directories)"));
      }
      resume_notes_.push_back(
          absl::StrCat("resume: no committed checkpoint in ", cc.folder(),
                       "; starting from step 0"));
    } else {
      FSDPP_RETURN_IF_ERROR(Resume(latest));
    }
  }
  result_.end_step = result_.start_step;
  return absl::OkStatus();
}

absl::Status Trainer::ResumeOwnCheckpoint() {
  const std::string& folder = config_.checkpoint().folder();
  absl::StatusOr<std::vector<CheckpointDir>> dirs = ScanCheckpoints(folder);
  if (!dirs.ok() && !absl::IsNotFound(dirs.status())) return dirs.status();
  const std::vector<CheckpointDir> found =
      dirs.ok() ? *std::move(dirs) : std::vector<CheckpointDir>{};
  std::string own, other;  // the newest of this job's, of another's
  for (auto d = found.rbegin(); d != found.rend(); ++d) {
    if (!d->committed) continue;
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
        CheckpointReader::Open(d->path);
    absl::StatusOr<std::string> job =
        reader.ok() ? (*reader)->ReadBytes(kJobKey) : reader.status();
    if (job.ok() && *job == job_) {
      own = d->path;
      break;
    }
    if (other.empty()) other = d->path;
  }
  if (!own.empty() && env_.restarted) {
    resume_notes_.push_back(absl::StrCat(
        "restart: resuming this job's latest checkpoint (", job_, ")"));
    FSDPP_RETURN_IF_ERROR(Resume(own));
  } else if (!other.empty() && own.empty()) {
    resume_notes_.push_back(absl::StrCat(
        env_.restarted ? "restart: no checkpoint of this job yet; " : "",
        "checkpoint: ", folder, " holds an earlier run's checkpoints (latest ",
        other,
        "): not resumed (checkpoint.resume=false), and this run's saves "
        "replace them step for step; --set checkpoint.resume=true continues "
        "that run instead"));
  }
  result_.end_step = result_.start_step;
  return absl::OkStatus();
}

absl::Status Trainer::Resume(const std::string& latest) {
  // Not strict: a pipeline rank holds only its stages' keys, the others'
  // are in the checkpoint too (CheckLoadedKeys: this rank's all there, the
  // others the model's).
  LoadOptions load_options;
  load_options.strict = false;
  // Checkpoints written before the key existed resume too (one without
  // kFrozenKey froze nothing).
  load_options.optional_prefixes = {models::kModelConfigKey, kJobKey,
                                    kFrozenKey, models::kLoraKey};
  // A checkpoint with inf / NaN (saved before this check existed, or by
  // another tool) is refused, naming the key.
  load_options.check_finite = true;
  absl::StatusOr<LoadResult> load = Load(&state_, latest, load_options);
  if (absl::IsDataLoss(load.status())) {
    // Damaged or non-finite: say which checkpoint to fall back to.
    std::string previous;
    absl::StatusOr<std::vector<CheckpointDir>> dirs =
        ScanCheckpoints(config_.checkpoint().folder());
    for (const CheckpointDir& d :
         dirs.ok() ? *dirs : std::vector<CheckpointDir>{}) {
      if (d.path == latest) break;
      if (d.committed) previous = d.path;
    }
    return absl::DataLossError(absl::StrCat(
        "trainer: resuming: ", load.status().message(), "; ",
        previous.empty()
            ? std::string("no committed checkpoint before it to resume from")
            : absl::StrCat("move ", latest, " aside to resume from ", previous,
                           ", the checkpoint before it")));
  }
  FSDPP_ASSIGN_OR_RETURN(LoadResult loaded,
                         Context(std::move(load), "trainer: resuming"));
  {
    // An optional key the checkpoint lacks reads as empty (older
    // checkpoints: nothing frozen, no adapters).
    const auto loaded_bytes =
        [&](const std::string& key) -> absl::StatusOr<std::string> {
      if (std::find(loaded.missing_keys.begin(), loaded.missing_keys.end(),
                    key) != loaded.missing_keys.end()) {
        return std::string();
      }
      return state_.bytes(key);
    };
    FSDPP_ASSIGN_OR_RETURN(const std::string text, loaded_bytes(kFrozenKey));
    FSDPP_ASSIGN_OR_RETURN(const FrozenRecord record,
                           FrozenRecord::Parse(text, latest));
    FSDPP_RETURN_IF_ERROR(CheckFrozen(latest, record));
    FSDPP_RETURN_IF_ERROR(state_.SetBytes(kFrozenKey, frozen_.ToString()));
    // The adapters' rank, scale and targets: the run's own.
    const std::string lora =
        rc_.layout.lora.enabled() ? models::LoraJson(rc_.layout.lora) : "";
    FSDPP_ASSIGN_OR_RETURN(const std::string theirs,
                           loaded_bytes(models::kLoraKey));
    if (theirs != lora) {
      return absl::FailedPreconditionError(absl::StrCat(
          "trainer: resuming from ", latest, ": its run's LoRA adapters (",
          theirs.empty() ? "none" : theirs, ") are not this run's (",
          lora.empty() ? "none" : lora, "): resume with the same model.lora"));
    }
    FSDPP_RETURN_IF_ERROR(state_.SetBytes(models::kLoraKey, lora));
  }
  FSDPP_RETURN_IF_ERROR(CheckLoadedKeys(loaded));
  FSDPP_ASSIGN_OR_RETURN(std::string steps_text, state_.bytes("train/step"));
  int64_t done = 0;
  if (!absl::SimpleAtoi(steps_text, &done) || done < 0) {
    return absl::DataLossError(
        absl::StrCat("trainer: ", latest,
                     ": train/step is not a step count: \"", steps_text, "\""));
  }
  FSDPP_ASSIGN_OR_RETURN(std::string ls, state_.bytes("train/loader"));
  LoaderState loader_state;
  if (!loader_state.ParseFromString(ls)) {
    return absl::DataLossError(
        absl::StrCat("trainer: ", latest, ": train/loader does not parse"));
  }
  FSDPP_RETURN_IF_ERROR(
      Annotate(loader_->Restore(loader_state),
               absl::StrCat("trainer: resuming from ", latest)));
  FSDPP_RETURN_IF_ERROR(training_->optimizer().SetStep(done));
  FSDPP_ASSIGN_OR_RETURN(std::string scaler_text,
                         state_.bytes("train/loss_scaler"));
  if (scaler_.has_value() && !scaler_text.empty()) {
    std::vector<std::string> parts = absl::StrSplit(scaler_text, ' ');
    float scale = 0;
    int64_t tracker = 0;
    if (parts.size() != 2 || !absl::SimpleAtof(parts[0], &scale) ||
        !absl::SimpleAtoi(parts[1], &tracker)) {
      return absl::DataLossError(
          absl::StrCat("trainer: ", latest, ": train/loss_scaler \"",
                       scaler_text, "\" is not \"<scale> <tracker>\""));
    }
    FSDPP_RETURN_IF_ERROR(scaler_->Restore(scale, tracker));
  }
  // Saves from here on are this job's (a run resumed on purpose from
  // another's checkpoint continues under its own identity).
  FSDPP_RETURN_IF_ERROR(state_.SetBytes(kJobKey, job_));
  result_.start_step = done;
  result_.resumed_from = latest;
  return absl::OkStatus();
}

std::string Trainer::FrozenSource() const {
  if (config_.model().has_init_from()) return config_.model().init_from();
  return absl::StrCat("seed ", config_.training().seed());
}

absl::Status Trainer::CheckFrozen(const std::string& dir,
                                  const FrozenRecord& record) const {
  const FrozenRecord& ours = frozen_;
  if (record.source == ours.source && record.names == ours.names) {
    return absl::OkStatus();
  }
  const auto describe = [](const FrozenRecord& r) {
    if (r.empty()) return std::string("trains every parameter");
    return absl::StrCat("freezes ", r.names.size(), " parameter(s) (",
                        r.names.front(), r.names.size() > 1 ? ", ..." : "",
                        ") whose values come from ", r.source);
  };
  return absl::FailedPreconditionError(absl::StrCat(
      "trainer: resuming from ", dir, ": its run ", describe(record),
      ", this run ", describe(ours),
      ". A checkpoint holds no frozen values, and holds the trained values "
      "of every other parameter: resume with the same model.freeze, "
      "model.init_from and training.seed, or start a new run from an export "
      "of it (tools/ckpt export, then model.init_from)"));
}

absl::Status Trainer::CheckLoadedKeys(const LoadResult& loaded) const {
  std::vector<std::string> missing;
  for (const std::string& key : loaded.missing_keys) {
    if (!absl::StartsWith(key, models::kModelConfigKey) && key != kJobKey) {
      missing.push_back(key);
    }
  }
  if (!missing.empty()) {
    return absl::NotFoundError(
        absl::StrCat("trainer: resuming: ", loaded.path,
                     ": the checkpoint lacks keys of this rank's state: ",
                     absl::StrJoin(missing, ", ")));
  }
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> meta,
                         models::Transformer::Create(rc_.model));
  std::set<std::string> model_keys;
  for (const auto& [name, p] : meta->NamedParameters()) {
    model_keys.insert("model/" + name);
    model_keys.insert("optim/" + name + ".exp_avg");
    model_keys.insert("optim/" + name + ".exp_avg_sq");
  }
  std::vector<std::string> foreign;
  for (const std::string& key : loaded.unexpected_keys) {
    if (!model_keys.count(key)) foreign.push_back(key);
  }
  if (!foreign.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer: resuming: ", loaded.path,
                     ": the checkpoint has keys no part of ", rc_.model.name,
                     " holds: ", absl::StrJoin(foreign, ", ")));
  }
  return absl::OkStatus();
}

// Checkpoint writer (asynchronous when configured).
absl::Status Trainer::BuildCheckpointWriter() {
  const CheckpointConfig& cc = config_.checkpoint();
  save_options_.mesh = mesh_.get();
  save_options_.timeout = rc_.comm_timeout;
  save_options_.keep_last = cc.keep_latest_k();
  // Never a checkpoint no run can resume from: inf / NaN anywhere in the
  // weights or the optimizer state fails the save before it commits.
  save_options_.check_finite = true;
  save_options_.store_prefix = "fsdpp/trainer/checkpoint";
  if (cc.interval() > 0 && cc.async()) {
    if (env_.store == nullptr && env_.world_size > 1) {
      return absl::InvalidArgumentError(
          "trainer: checkpoint.async needs the rendezvous store");
    }
    save_options_.store = env_.store;
    FSDPP_ASSIGN_OR_RETURN(async_saver_,
                           AsyncSaver::Create(cc.folder(), save_options_));
  }
  return absl::OkStatus();
}

// Metrics: the JSONL, FLOPs per token, the MFU peak; then the header.
absl::Status Trainer::BuildMetrics() {
  const MetricsConfig& mc = config_.metrics();
  if (env_.rank == 0 && !mc.jsonl_path().empty()) {
    FSDPP_ASSIGN_OR_RETURN(jsonl_, JsonlWriter::Open(mc.jsonl_path()));
  }
  // Frozen weights skip their weight gradients; LoRA's adapters add theirs.
  FSDPP_ASSIGN_OR_RETURN(flops_per_token_, rc_.layout.FlopsPerToken(rc_.model));
  peak_ = mc.peak_tflops() * 1e12;
  std::string peak_source = "metrics.peak_tflops";
  const DType peak_dtype =
      rc_.layout.param_dtype == DType::kF32 ? DType::kF32 : DType::kBF16;
  if (peak_ <= 0 && env_.device.is_cuda()) {
    // A GPU's dense data-sheet peak, by its name.
    FSDPP_ASSIGN_OR_RETURN(const std::string name,
                           GpuName(env_.device.index()));
    peak_ = plan::GpuPeakFlops(name, peak_dtype);
    if (peak_ <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "trainer: no data-sheet peak for the GPU \"", name,
          "\" (plan/rates.cc); set metrics.peak_tflops for its MFU"));
    }
    peak_source = absl::StrFormat("data sheet: %s, dense %s", name,
                                  DTypeName(peak_dtype));
  } else if (peak_ <= 0) {
    FSDPP_ASSIGN_OR_RETURN(
        peak_,
        plan::MeasureMatmulFlops(
            rc_.layout.param_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32,
            kPeakMatmulN, kPeakBudget));
    // The slowest rank's number: all ranks share the machine.
    std::vector<double> p = {-peak_};
    FSDPP_RETURN_IF_ERROR(AllReduceValues(world_, &p, ReduceOp::kMax));
    peak_ = -p[0];
    peak_source = absl::StrFormat(
        "measured: %d^3 %s matmul, all ranks at once", kPeakMatmulN,
        DTypeName(rc_.layout.param_dtype == DType::kBF16 ? DType::kBF16
                                                         : DType::kF32));
  }
  // The measurement's matrices (12 MiB in f32) are no part of training: the
  // peaks restart here, so that the reported peak is the training's own
  // (the sharded state is live, so it stays counted).
  if (Allocator* host = GetAllocator(Device::Cpu())) host->ResetPeak();
  if (Allocator* device = GetAllocator(env_.device)) device->ResetPeak();
  result_.peak_tflops_per_rank = peak_ / 1e12;
  return PrintHeader(peak_source);
}

// The run's header (printed and as the JSONL's "run" line) and the memory
// table at the start.
absl::Status Trainer::PrintHeader(const std::string& peak_source) {
  const TrainingConfig& tc = config_.training();
  const int64_t num_params = models::NumParameters(rc_.model);
  const recipe::Layout::ParameterCounts& counts = counts_;
  print_->Line(absl::StrFormat(
      "fsdpp trainer: %s (%s parameters, %s trainable) on %d rank(s), mesh "
      "%s, %s\n"
      "  data: %s\n"
      "  batch: %d sequences x %d tokens = %d tokens/step (micro batch %d, "
      "%d accumulation step(s))\n"
      "  unigram baseline loss: %.4f nats (the loss of predicting token "
      "frequencies)\n"
      "  MFU peak: %.3f TFLOP/s per rank (%s); %.3g model FLOPs per token",
      config_.model().name(), absl::StrFormat("%.2fM", counts.total / 1e6),
      absl::StrFormat("%.2fM", counts.trainable / 1e6), env_.world_size,
      mesh_->ToString(),
      !rc_.layout.reshard_after_backward ? "ZeRO-1"
      : rc_.layout.reshard_after_forward ? "ZeRO-3"
                                         : "ZeRO-2",
      data_.description, tc.global_batch(), rc_.layout.seq_len,
      rc_.tokens_per_step, rc_.layout.micro_batch, rc_.layout.grad_accumulation,
      result_.unigram_loss, result_.peak_tflops_per_rank, peak_source,
      flops_per_token_));
  if (env_.device.is_cpu()) {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    print_->Line(absl::StrFormat(
        "  CPU: %d OpenMP thread(s) per rank, OMP_WAIT_POLICY %s; %s",
        ParallelThreads(),
        policy != nullptr ? policy : "unset (OpenMP's default)",
        cpu::OneDnnBf16MatmulModeDescription()));
  }
  const models::LoraOptions& lora = rc_.layout.lora;
  if (lora.enabled()) {
    print_->Line(absl::StrFormat(
        "  LoRA: rank %d, alpha %g%s on %s; the adapters train, the base is "
        "frozen",
        lora.rank, lora.alpha,
        lora.dropout > 0 ? absl::StrFormat(", dropout %g", lora.dropout)
                         : std::string(),
        absl::StrJoin(lora.targets, ",")));
  }
  if (!rc_.layout.freeze.empty() || lora.enabled()) {
    print_->Line(absl::StrFormat(
        "  frozen: %.2fM parameters (%s): no gradients or optimizer state; "
        "checkpoints reference them (%s)",
        (counts.total - counts.trainable) / 1e6,
        rc_.layout.freeze.empty()
            ? std::string("model.lora")
            : absl::StrCat("model.freeze ",
                           absl::StrJoin(rc_.layout.freeze, ",")),
        FrozenSource()));
  }
  if (rc_.layout.document_eot_id >= 0) {
    print_->Line(absl::StrCat(
        "  documents: masked at end-of-text id ", rc_.layout.document_eot_id,
        " (attention and positions stay within each packed document; "
        "data.document_masking)"));
  }
  for (const std::string& note : rc_.notes) print_->Line("  " + note);
  for (const std::string& line : training_->Describe()) {
    print_->Line("  " + line);
  }
  if (!plan_note_.empty()) print_->Line(plan_note_);
  if (!init_note_.empty()) print_->Line(init_note_);
  for (const std::string& note : resume_notes_) print_->Line(note);
  if (!result_.resumed_from.empty()) {
    print_->Line(absl::StrFormat("resumed from %s: %d step(s) done",
                                 result_.resumed_from, result_.start_step));
  }
  if (jsonl_ != nullptr) {
    RunRecord run;
    run.model = config_.model().name();
    run.world_size = env_.world_size;
    run.params = num_params;
    run.trainable_params = counts.trainable;
    run.tokens_per_step = rc_.tokens_per_step;
    run.steps = tc.steps();
    run.start_step = result_.start_step;
    run.unigram_loss = result_.unigram_loss;
    run.peak_tflops_per_rank = result_.peak_tflops_per_rank;
    run.flops_per_token = flops_per_token_;
    FSDPP_RETURN_IF_ERROR(jsonl_->WriteRecord(run));
  }
  FSDPP_ASSIGN_OR_RETURN(std::vector<MemoryStats> mem,
                         GatherMemory(world_, env_.device));
  print_->Line(FormatMemoryTable(mem,
                                 "Memory per rank at start (sharded state "
                                 "allocated, before the first step):"));
  return absl::OkStatus();
}

bool Trainer::done() const {
  return result_.end_step >= config_.training().steps();
}

absl::StatusOr<TrainResult> Trainer::Run() {
  while (!done()) {
    const int64_t next = result_.end_step + 1;
    if (env_.stop_after_steps > 0 &&
        next > result_.start_step + env_.stop_after_steps) {
      if (async_saver_ != nullptr) FSDPP_RETURN_IF_ERROR(async_saver_->Wait());
      FSDPP_RETURN_IF_ERROR(ReadStepValues());
      print_->Line(absl::StrFormat("stopping after step %d (stop_after_steps)",
                                   next - 1));
      return result_;
    }
    FSDPP_RETURN_IF_ERROR(TrainStep());
    FSDPP_RETURN_IF_ERROR(LogStep());
    if (ValidationDue()) FSDPP_RETURN_IF_ERROR(Validate());
    FSDPP_RETURN_IF_ERROR(MaybeSave());
    FSDPP_RETURN_IF_ERROR(MaybeWriteTrace());
    FSDPP_RETURN_IF_ERROR(MaybeReportProfile());
  }
  FSDPP_RETURN_IF_ERROR(Summarize());
  return result_;
}

absl::Status Trainer::TrainStep() {
  if (done()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("trainer: all %d steps are done", result_.end_step));
  }
  const TrainingConfig& tc = config_.training();
  const MetricsConfig& mc = config_.metrics();
  const int64_t step = result_.end_step + 1;
  const int64_t trace_begin = mc.trace_start_step(),
                trace_end = mc.trace_start_step() + mc.trace_steps();
  const bool tracing =
      mc.trace_steps() > 0 && step >= trace_begin && step < trace_end;
  trace_->SetRecording(tracing);
  wait_before_ = trace_->TotalMicros("comm_wait");
  const absl::Time t0 = step_start_ = absl::Now();
  syncs_before_ = HostSyncCount();
  StepLog log;
  log.step = step;
  if (scaler_.has_value()) log.loss_scale = scaler_->scale();
  FSDPP_RETURN_IF_ERROR(CheckPendingSave(step));
  const int64_t profile_begin = ProfileBegin();
  const bool profiling = mc.profile_steps() > 0 && step >= profile_begin &&
                         step < profile_begin + mc.profile_steps();
  std::optional<ScopedOpProfile> profile_scope;
  if (profiling) profile_scope.emplace(&op_profile_);
  const absl::Time profile_t0 = absl::Now();
  {
    TraceSpan step_span("step", "step");
    FSDPP_ASSIGN_OR_RETURN(
        last_step_, Context(training_->ForwardBackward(
                                LoaderBatches(loader_.get(), env_.device,
                                              rc_.layout.grad_accumulation),
                                log.loss_scale),
                            absl::StrCat("step ", step)));
    log.loss = last_step_.loss;
    if (data_group_ != nullptr) {
      log.expert_tokens.assign(rc_.model.moe.num_experts, 0);
      double aux_sum = 0.0;
      for (models::Transformer* model : training_->models()) {
        const nn::MoE::Stats stats = model->TakeMoeStats();
        for (size_t e = 0; e < stats.tokens.size(); ++e) {
          log.expert_tokens[e] += stats.tokens[e];
        }
        aux_sum += stats.aux_loss_sum;
      }
      log.aux_loss = aux_sum / rc_.layout.grad_accumulation;
    }
    // Values on the device: NaN until read (LogStep).
    if (!training_->values_on_device() && !std::isfinite(log.loss)) {
      return absl::InternalError(absl::StrFormat(
          "step %d: the loss is %f; stopping before the optimizer step. %s",
          step, log.loss, DivergenceAdvice(step)));
    }
    FSDPP_RETURN_IF_ERROR(OptimizerStep(&log));
  }
  if (profiling) {
    profile_scope.reset();
    profiled_ns_ += absl::ToInt64Nanoseconds(absl::Now() - profile_t0);
    ++profiled_steps_;
  }
  log.step_s = absl::ToDoubleSeconds(absl::Now() - t0);
  log.host_syncs = HostSyncCount() - syncs_before_;
  ReportMemory(absl::StrCat("after step ", step));
  result_.steps.push_back(log);
  result_.end_step = step;
  warmup_ = step - result_.start_step <= mc.throughput_warmup_steps() &&
            step < tc.steps();
  meter_.Add(log.step_s, rc_.tokens_per_step, warmup_);
  if (!warmup_) {
    comm_wait_us_ += trace_->TotalMicros("comm_wait") - wait_before_;
    ++comm_steps_;
    step_totals_.compute_seconds += last_step_.compute_seconds;
    step_totals_.wait_seconds += last_step_.wait_seconds;
  }
  step_totals_.peak_held_bytes =
      std::max(step_totals_.peak_held_bytes, last_step_.peak_held_bytes);
  return absl::OkStatus();
}

absl::Status Trainer::CheckPendingSave(int64_t step) {
  if (pending_save_ == nullptr) return absl::OkStatus();
  // Every rank stops at the same step: whether any rank's save failed, and
  // whether any is still writing.
  const bool done = pending_save_->IsDone();
  absl::Status failed =
      done ? pending_save_->Wait().status() : absl::OkStatus();
  std::vector<double> v = {failed.ok() ? 0.0 : 1.0, done ? 0.0 : 1.0};
  FSDPP_RETURN_IF_ERROR(
      Annotate(AllReduceValues(world_, &v, ReduceOp::kMax),
               absl::StrCat("step ", step,
                            ": agreeing on the asynchronous checkpoint")));
  if (v[0] > 0) {
    const int64_t saved = pending_save_->step();
    pending_save_.reset();
    absl::StatusOr<std::string> committed =
        LatestCheckpoint(config_.checkpoint().folder());
    return absl::DataLossError(absl::StrFormat(
        "step %d: the asynchronous checkpoint of step %d failed (%s); "
        "stopping so that no interval of work goes unprotected. The latest "
        "committed checkpoint is %s; fix the cause (disk space?) and resume.",
        step, saved,
        failed.ok() ? std::string("on another rank") : failed.ToString(),
        committed.ok() ? *committed : std::string("none")));
  }
  if (v[1] == 0) pending_save_.reset();  // committed on every rank
  return absl::OkStatus();
}

absl::Status Trainer::OptimizerStep(StepLog* log) {
  recipe::OptimizerStepOptions options;
  options.lr = schedule_->LrAt(training_->optimizer().step());
  options.grad_clip = config_.training().grad_clip();
  options.scaler = scaler_.has_value() ? &*scaler_ : nullptr;
  FSDPP_ASSIGN_OR_RETURN(const recipe::OptimizerStepResult result,
                         training_->OptimizerStep(options));
  log->grad_norm = result.grad_norm;
  log->skipped = result.skipped;
  if (result.on_device) {  // read later (ReadStepValues)
    log->lr = options.lr;
    return absl::OkStatus();
  }
  if (result.skipped) {
    print_->Line(absl::StrFormat(
        "step %d: gradients overflowed at loss scale %g; optimizer step "
        "skipped, scale now %g",
        log->step, log->loss_scale, scaler_->scale()));
    return absl::OkStatus();
  }
  if (!result.applied) {
    return absl::InternalError(absl::StrFormat(
        "step %d: the gradient norm is %f (loss %.4f); stopping before "
        "the optimizer step. %s",
        log->step, log->grad_norm, log->loss, DivergenceAdvice(log->step)));
  }
  log->lr = options.lr;
  return absl::OkStatus();
}

std::string Trainer::DivergenceAdvice(int64_t bad_step) const {
  const std::string saved =
      absl::StrCat("Nothing was saved after step ", bad_step - 1,
                   result_.last_checkpoint.empty()
                       ? std::string()
                       : absl::StrCat("; the latest checkpoint is ",
                                      result_.last_checkpoint),
                   ".");
  if (bad_step == result_.start_step + 1 && !result_.resumed_from.empty()) {
    // Resuming it again would loop: the checkpoint itself may be bad.
    return absl::StrCat(
        saved, " This is the first step after resuming ", result_.resumed_from,
        ": its weights or optimizer state may not be finite (`bazel run "
        "//tools/ckpt -- inspect --verify ",
        result_.resumed_from,
        "` says); resume from the checkpoint before it (move this one "
        "aside), or lower training.lr.");
  }
  return absl::StrCat(saved,
                      " Lower training.lr or enable clipping and resume.");
}

bool Trainer::SaveDue() const {
  const CheckpointConfig& cc = config_.checkpoint();
  const int64_t step = result_.end_step;
  return cc.interval() > 0 && step > result_.start_step &&
         (step % cc.interval() == 0 || step == config_.training().steps());
}

absl::Status Trainer::ReadStepValues() {
  FSDPP_ASSIGN_OR_RETURN(
      const std::vector<recipe::Training::StepValues> values,
      Context(training_->ReadStepValues(),
              absl::StrCat("step ", result_.end_step,
                           ": reading the steps' loss and gradient norm")));
  const size_t first = result_.steps.size() - values.size();
  for (size_t i = 0; i < values.size(); ++i) {
    StepLog& log = result_.steps[first + i];
    log.loss = values[i].loss;
    log.grad_norm = values[i].grad_norm;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i].applied()) continue;
    const StepLog& log = result_.steps[first + i];
    const std::string what =
        std::isfinite(log.loss)
            ? absl::StrFormat("the gradient norm is %f (loss %.4f)",
                              log.grad_norm, log.loss)
            : absl::StrFormat("the loss is %f", log.loss);
    return absl::InternalError(absl::StrFormat(
        "step %d: %s; the optimizer skipped the step on the device, and "
        "the steps after it (to step %d, when their values were read) are "
        "not kept. %s",
        log.step, what, result_.end_step, DivergenceAdvice(log.step)));
  }
  return absl::OkStatus();
}

absl::Status Trainer::LogStep() {
  if (result_.steps.empty()) {
    return absl::FailedPreconditionError("trainer: no step to log yet");
  }
  const TrainingConfig& tc = config_.training();
  const MetricsConfig& mc = config_.metrics();
  const int64_t step = result_.steps.back().step;
  const bool log_now = step % mc.log_interval() == 0 || step == tc.steps() ||
                       step == result_.start_step + 1;
  // The last warm-up step is read too, so that the measured steps' time
  // starts with the GPU caught up.
  const bool warmup_ends =
      step == result_.start_step + mc.throughput_warmup_steps();
  if (training_->pending_steps() > 0 &&
      (log_now || SaveDue() || warmup_ends ||
       training_->pending_steps() == recipe::Training::kMaxPendingSteps ||
       (env_.stop_after_steps > 0 &&
        step >= result_.start_step + env_.stop_after_steps))) {
    // The steps' values from the device: this step's time and host syncs
    // include the wait.
    const absl::Time read_start = absl::Now();
    FSDPP_RETURN_IF_ERROR(ReadStepValues());
    meter_.AddToLast(absl::ToDoubleSeconds(absl::Now() - read_start), warmup_);
    StepLog& last = result_.steps.back();
    last.step_s = absl::ToDoubleSeconds(absl::Now() - step_start_);
    last.host_syncs = HostSyncCount() - syncs_before_;
  }
  if (data_group_ != nullptr && log_now) {
    // The MoE stats over the data-parallel ranks (every rank logs now).
    StepLog& last = result_.steps.back();
    std::vector<double> values = {last.aux_loss};
    values.insert(values.end(), last.expert_tokens.begin(),
                  last.expert_tokens.end());
    FSDPP_RETURN_IF_ERROR(
        Annotate(AllReduceValues(data_group_, &values, ReduceOp::kSum),
                 absl::StrCat("step ", step, ": the MoE stats")));
    last.aux_loss = values[0] / data_group_->size();
    for (size_t e = 0; e < last.expert_tokens.size(); ++e) {
      last.expert_tokens[e] = static_cast<int64_t>(std::llround(values[e + 1]));
    }
  }
  const StepLog& log = result_.steps.back();
  host_syncs_ += log.host_syncs;
  const bool pending = training_->pending_steps() > 0;
  const double tps_now = rc_.tokens_per_step / std::max(log.step_s, 1e-9);
  // Model FLOPs utilisation of one rank at `tokens_per_s` over all ranks.
  auto mfu = [&](double tokens_per_s) {
    return flops_per_token_ * tokens_per_s / env_.world_size /
           std::max(peak_, 1.0);
  };
  const double mfu_now = mfu(tps_now);
  const double eta = meter_.mean_step_s() * (tc.steps() - step);
  std::string line = TrainLine(
      log, pending, tc.steps(),
      meter_.measured_steps() > 0 ? meter_.tokens_per_s() : tps_now,
      meter_.measured_steps() > 0 ? mfu(meter_.tokens_per_s()) : mfu_now, eta);
  if (data_group_ != nullptr && log_now) {
    // The busiest expert's tokens over the mean (1 = balanced).
    int64_t most = 0, all = 0;
    for (int64_t n : log.expert_tokens) {
      most = std::max(most, n);
      all += n;
    }
    const double mean = static_cast<double>(all) /
                        std::max<size_t>(log.expert_tokens.size(), 1);
    absl::StrAppendFormat(&line, " | aux %.4f | expert load max/mean %.2f",
                          log.aux_loss, mean > 0 ? most / mean : 0.0);
  }
  print_->Progress(line, log_now);
  if (jsonl_ == nullptr || !log_now) return absl::OkStatus();
  TrainRecord record;
  record.step = step;
  record.loss = log.loss;
  record.lr = log.lr;
  record.grad_norm = log.grad_norm;
  record.tokens_per_s = tps_now;
  record.tokens_per_s_per_rank = tps_now / env_.world_size;
  record.tflops_per_rank = flops_per_token_ * tps_now / env_.world_size / 1e12;
  record.mfu = mfu_now;
  record.step_time_s = log.step_s;
  record.exposed_comm_s =
      (trace_->TotalMicros("comm_wait") - wait_before_) / 1e6;
  record.elapsed_s = absl::ToDoubleSeconds(absl::Now() - run_start_);
  record.warmup = warmup_;
  record.has_loss_scale = scaler_.has_value();
  record.loss_scale = log.loss_scale;
  record.skipped = log.skipped;
  if (env_.device.is_cuda()) record.host_syncs = log.host_syncs;
  record.aux_loss = log.aux_loss;
  record.expert_tokens = log.expert_tokens;
  return jsonl_->WriteRecord(record);
}

bool Trainer::ValidationDue() const {
  const int64_t step = result_.end_step;
  return val_loader_ != nullptr && step > result_.start_step &&
         (step % config_.validation().interval() == 0 ||
          step == config_.training().steps());
}

absl::Status Trainer::Validate() {
  if (val_loader_ == nullptr) {
    return absl::FailedPreconditionError(
        "trainer: no validation (validation.interval is 0 or the "
        "validation split is empty)");
  }
  const ValidationConfig& vc = config_.validation();
  const int64_t step = result_.end_step;
  TraceSpan span("validation", "compute");
  val_loader_->Reset();
  // validation.batches global batches, dealt to the data-parallel ranks as
  // training's are: the same sequences (the first batches x global_batch
  // windows of the split), so the same loss, at every layout.
  const int64_t micro_batches = vc.batches() * rc_.layout.grad_accumulation;
  FSDPP_ASSIGN_OR_RETURN(
      const double loss,
      Context(training_->Evaluate(
                  micro_batches,
                  LoaderBatches(val_loader_.get(), env_.device, micro_batches)),
              absl::StrCat("step ", step, " validation")));
  result_.validation.emplace_back(step, loss);
  print_->Line(absl::StrFormat(
      "validation: step %d loss %.4f (%d sequences: %d global batch(es))", step,
      loss, vc.batches() * config_.training().global_batch(), vc.batches()));
  if (jsonl_ == nullptr) return absl::OkStatus();
  return jsonl_->WriteRecord(ValidationRecord{step, loss});
}

absl::Status Trainer::MaybeSave() {
  if (!SaveDue()) return absl::OkStatus();
  // Never a checkpoint of a step whose values were not seen (LogStep read
  // them already when it ran).
  FSDPP_RETURN_IF_ERROR(ReadStepValues());
  return Save();
}

absl::Status Trainer::Save() {
  const CheckpointConfig& cc = config_.checkpoint();
  const int64_t step = result_.end_step;
  TraceSpan span("checkpoint", "checkpoint");
  FSDPP_RETURN_IF_ERROR(state_.SetBytes("train/step", absl::StrCat(step)));
  FSDPP_RETURN_IF_ERROR(
      state_.SetBytes("train/loader", loader_->state().SerializeAsString()));
  FSDPP_RETURN_IF_ERROR(state_.SetBytes(
      "train/loss_scaler", scaler_.has_value()
                               ? absl::StrFormat("%.9g %d", scaler_->scale(),
                                                 scaler_->growth_tracker())
                               : ""));
  if (async_saver_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<PendingSave> pending,
                           async_saver_->Save(state_, step));
    pending_save_ = pending;
    result_.last_checkpoint =
        absl::StrCat(cc.folder(), "/", CheckpointDirName(step));
    print_->Line(absl::StrFormat(
        "checkpoint: step %d saving in the background to %s (blocked "
        "%.0f ms)",
        step, result_.last_checkpoint,
        absl::ToDoubleMilliseconds(pending->blocking_time())));
    return absl::OkStatus();
  }
  FSDPP_ASSIGN_OR_RETURN(SaveResult saved,
                         fsdpp::Save(state_, cc.folder(), step, save_options_));
  result_.last_checkpoint = saved.path;
  print_->Line(absl::StrFormat(
      "checkpoint: step %d saved to %s (%.1f MiB in %.2f s)", step, saved.path,
      saved.total_bytes / 1048576.0, absl::ToDoubleSeconds(saved.total_time)));
  return absl::OkStatus();
}

absl::Status Trainer::MaybeWriteTrace() {
  const TrainingConfig& tc = config_.training();
  const MetricsConfig& mc = config_.metrics();
  const int64_t step = result_.end_step;
  const int64_t trace_begin = mc.trace_start_step(),
                trace_end = mc.trace_start_step() + mc.trace_steps();
  if (mc.trace_steps() <= 0 || step <= result_.start_step ||
      step != std::min(trace_end, tc.steps() + 1) - 1 || step < trace_begin) {
    return absl::OkStatus();
  }
  trace_->SetRecording(false);
  FSDPP_ASSIGN_OR_RETURN(std::vector<std::string> pieces,
                         AllGatherStrings(world_, trace_->EventsJson()));
  trace_->ClearEvents();
  if (env_.rank == 0) {
    // Its folder may be no other output's (the default fsdpp_run/ when
    // checkpoints and metrics go elsewhere).
    const std::string dir = DirName(mc.trace_path());
    if (!dir.empty()) FSDPP_RETURN_IF_ERROR(MakeDirs(dir));
    FSDPP_RETURN_IF_ERROR(
        WriteTraceFile(mc.trace_path(), ChromeTraceJson(pieces)));
    print_->Line(absl::StrFormat(
        "trace: steps %d-%d of every rank written to %s (open in "
        "https://ui.perfetto.dev)",
        trace_begin, step, mc.trace_path()));
  }
  return absl::OkStatus();
}

int64_t Trainer::ProfileBegin() const {
  return std::min(
      result_.start_step + config_.metrics().throughput_warmup_steps() + 1,
      config_.training().steps());
}

absl::Status Trainer::MaybeReportProfile() {
  const MetricsConfig& mc = config_.metrics();
  const int64_t step = result_.end_step;
  const int64_t last = std::min(ProfileBegin() + mc.profile_steps(),
                                config_.training().steps() + 1) -
                       1;
  if (mc.profile_steps() <= 0 || step != last || profiled_steps_ == 0) {
    return absl::OkStatus();
  }
  const std::vector<OpProfile::Row> rows = op_profile_.Rows();
  op_profile_.Clear();
  print_->Line(absl::StrFormat(
      "profile: rank 0, steps %d-%d (\"step\": the step's time in no op; "
      "\"comm_wait\": exposed communication):",
      step - profiled_steps_ + 1, step));
  for (absl::string_view line :
       absl::StrSplit(FormatOpTable(rows, profiled_ns_, profiled_steps_), '\n',
                      absl::SkipEmpty())) {
    print_->Line(std::string(line));
  }
  if (jsonl_ != nullptr) {
    for (const OpProfile::Row& r : rows) {
      ProfileRecord record;
      record.op = r.name;
      record.category = r.category;
      record.steps = profiled_steps_;
      record.calls_per_step = static_cast<double>(r.calls) / profiled_steps_;
      record.self_ms_per_step = r.self_ns / 1e6 / profiled_steps_;
      record.total_ms_per_step = r.total_ns / 1e6 / profiled_steps_;
      record.share_of_step =
          profiled_ns_ > 0 ? static_cast<double>(r.self_ns) / profiled_ns_ : 0;
      FSDPP_RETURN_IF_ERROR(jsonl_->WriteRecord(record));
    }
  }
  profiled_ns_ = profiled_steps_ = 0;
  return absl::OkStatus();
}

absl::Status Trainer::Summarize() {
  const TrainingConfig& tc = config_.training();
  trace_->SetRecording(false);
  FSDPP_RETURN_IF_ERROR(ReadStepValues());
  if (async_saver_ != nullptr) {
    FSDPP_RETURN_IF_ERROR(
        Annotate(async_saver_->Wait(), "trainer: the last checkpoint"));
  }
  // Old checkpoints dropped by keep_latest_k are deleted in the background;
  // finish before the process may exit.
  FSDPP_RETURN_IF_ERROR(WaitForCheckpointCleanup());

  result_.tokens_per_s = meter_.tokens_per_s();
  result_.tokens_per_s_per_rank = result_.tokens_per_s / env_.world_size;
  result_.tflops_per_rank =
      flops_per_token_ * result_.tokens_per_s_per_rank / 1e12;
  result_.mfu = peak_ > 0 ? result_.tflops_per_rank * 1e12 / peak_ : 0;
  result_.exposed_comm_s_per_step =
      comm_steps_ > 0 ? comm_wait_us_ / 1e6 / comm_steps_ : 0;
  result_.memory = GetAllocator(env_.device)->Stats();
  FSDPP_ASSIGN_OR_RETURN(std::vector<MemoryStats> mem,
                         Context(GatherMemory(world_, env_.device),
                                 "the end of the run: gathering memory"));
  std::vector<double> comm = {result_.exposed_comm_s_per_step};
  FSDPP_RETURN_IF_ERROR(
      Annotate(AllReduceValues(world_, &comm, ReduceOp::kMax),
               "the end of the run: gathering the exposed communication"));
  // The step's own report (the pipeline's waits, every rank's).
  const double busy = step_totals_.compute_seconds + step_totals_.wait_seconds;
  result_.pipeline_bubble = busy > 0 ? step_totals_.wait_seconds / busy : 0;
  result_.pipeline_peak_held_bytes = step_totals_.peak_held_bytes;
  FSDPP_ASSIGN_OR_RETURN(const std::string table,
                         training_->ReportTable(step_totals_));
  if (result_.steps.empty()) {
    print_->Line(absl::StrFormat("nothing to do: %d of %d steps already done",
                                 result_.start_step, tc.steps()));
    return absl::OkStatus();
  }
  FSDPP_RETURN_IF_ERROR(PrintResults(mem, comm[0]));
  if (!table.empty()) print_->Line(table);
  return absl::OkStatus();
}

absl::Status Trainer::PrintResults(const std::vector<MemoryStats>& mem,
                                   double exposed_comm_s) {
  const MetricsConfig& mc = config_.metrics();
  const StepLog& last = result_.steps.back();
  print_->Line(FormatMemoryTable(mem, "Memory per rank at the end:"));
  print_->Line(absl::StrFormat(
      "Results (steps %d-%d, %d warm-up step(s) excluded from throughput):\n"
      "  Loss:              %.4f (unigram baseline %.4f)%s\n"
      "  Time/step:         %.3f s\n"
      "  Tokens/sec:        %.0f\n"
      "  Tokens/sec/rank:   %.0f\n"
      "  TFLOP/s per rank:  %.4f\n"
      "  Peak per rank:     %.4f TFLOP/s\n"
      "  MFU:               %.2f%%\n"
      "  Exposed comm/step: %.1f ms (slowest rank)\n"
      "  Peak memory/rank:  %.1f MiB%s",
      result_.start_step + 1, result_.end_step,
      std::min<int64_t>(mc.throughput_warmup_steps(),
                        result_.end_step - result_.start_step - 1),
      last.loss, result_.unigram_loss,
      result_.validation.empty()
          ? ""
          : absl::StrFormat("; validation %.4f",
                            result_.validation.back().second),
      meter_.mean_step_s(), result_.tokens_per_s, result_.tokens_per_s_per_rank,
      result_.tflops_per_rank, result_.peak_tflops_per_rank, 100 * result_.mfu,
      1000 * exposed_comm_s,
      std::max_element(
          mem.begin(), mem.end(),
          [](const MemoryStats& a, const MemoryStats& b) {
            return a.total_peak < b.total_peak;
          })->total_peak /
          1048576.0,
      plan_peak_bytes_ > 0
          ? absl::StrFormat(
                " (planned %.1f MiB for one step%s)",
                plan_peak_bytes_ / 1048576.0,
                // Under expert parallelism a rank's expert activations
                // follow the routing; the plan takes it as even.
                rc_.layout.ep > 1 ? " with evenly routed tokens" : "")
          : std::string()));
  if (env_.device.is_cuda()) {
    const int64_t steps = result_.end_step - result_.start_step;
    print_->Line(absl::StrFormat(
        "  Host syncs:        %d in %d steps (%s)", host_syncs_, steps,
        training_->values_on_device()
            ? "the loss and gradient norm read at logged steps, saves and the "
              "warm-up's end"
            : "the loss and gradient norm read every step"));
  }
  if (jsonl_ == nullptr) return absl::OkStatus();
  SummaryRecord summary;
  summary.steps = result_.end_step;
  summary.loss = last.loss;
  summary.val_loss = result_.validation.empty()
                         ? std::numeric_limits<double>::quiet_NaN()
                         : result_.validation.back().second;
  summary.tokens_per_s = result_.tokens_per_s;
  summary.tokens_per_s_per_rank = result_.tokens_per_s_per_rank;
  summary.tflops_per_rank = result_.tflops_per_rank;
  summary.mfu = result_.mfu;
  summary.exposed_comm_s_per_step = exposed_comm_s;
  summary.step_time_s = meter_.mean_step_s();
  if (env_.device.is_cuda()) summary.host_syncs = host_syncs_;
  return jsonl_->WriteRecord(summary);
}

}  // namespace trainer
}  // namespace fsdpp
