#include "trainer/trainer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/state_dict.h"
#include "core/json_quote.h"
#include "core/logging.h"
#include "core/status.h"
#include "core/trace.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/gpt2/parallelize.h"
#include "models/llama/parallelize.h"
#include "models/transformer.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/lr_schedule.h"
#include "tensor/tensor.h"
#include "trainer/config.h"
#include "trainer/dataset.h"
#include "trainer/data/loader.h"
#include "trainer/metrics.h"

namespace fsdpp {
namespace trainer {
namespace {

// `value`, or its error with `context` in front.
template <typename T>
absl::StatusOr<T> Context(absl::StatusOr<T> value, absl::string_view context) {
  if (!value.ok()) return Annotate(value.status(), context);
  return value;
}

// Bound of every wait on the other ranks in the loop's own collectives.
constexpr absl::Duration kTimeout = absl::Minutes(10);
// The unigram baseline is estimated on at most this many tokens.
constexpr int64_t kUnigramTokens = 16 << 20;
// Matmul size and time budget of the CPU peak measurement.
constexpr int64_t kPeakMatmulN = 1024;
constexpr absl::Duration kPeakBudget = absl::Milliseconds(600);

// Rank 0's printer.
class Printer {
 public:
  Printer(const TrainerEnv& env) : env_(env) {}
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

absl::StatusOr<LrDecay> ParseDecay(const std::string& name) {
  if (name == "cosine") return LrDecay::kCosine;
  if (name == "linear") return LrDecay::kLinear;
  if (name == "constant") return LrDecay::kConstant;
  return absl::InvalidArgumentError(
      absl::StrCat("training.schedule: unknown \"", name, "\""));
}

// Sum (or max) of `values` over the ranks of `group`, in place.
absl::Status AllReduce(ProcessGroup* group, std::vector<double>* values,
                       ReduceOp op) {
  // In f32 (the collectives' float type): the values are losses and times
  // for the logs.
  std::vector<float> f(values->begin(), values->end());
  Buffer b{f.data(), static_cast<int64_t>(f.size()), DType::kF32,
           Device::Cpu()};
  CollectiveOptions o;
  o.timeout = kTimeout;
  o.async_op = false;  // Waited for at once: no comm-thread hand-offs.
  ASSIGN_OR_RETURN(std::shared_ptr<Work> work, group->AllReduce(b, op, o));
  RETURN_IF_ERROR(work->Wait(kTimeout));
  for (size_t i = 0; i < f.size(); ++i) (*values)[i] = f[i];
  return absl::OkStatus();
}

// Every rank's `values` (the same count on each), concatenated in rank
// order.
absl::StatusOr<std::vector<int64_t>> AllGatherInts(
    ProcessGroup* group, std::vector<int64_t> values) {
  std::vector<int64_t> out(values.size() * group->size());
  CollectiveOptions o;
  o.timeout = kTimeout;
  o.async_op = false;  // Waited for at once: no comm-thread hand-offs.
  ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      group->AllGather(
          Buffer{values.data(), static_cast<int64_t>(values.size()),
                 DType::kI64, Device::Cpu()},
          Buffer{out.data(), static_cast<int64_t>(out.size()), DType::kI64,
                 Device::Cpu()},
          o));
  RETURN_IF_ERROR(work->Wait(kTimeout));
  return out;
}

// Every rank's string, in rank order (two all-gathers: sizes, then bytes
// padded to the longest).
absl::StatusOr<std::vector<std::string>> AllGatherStrings(
    ProcessGroup* group, const std::string& mine) {
  ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                   AllGatherInts(group, {static_cast<int64_t>(mine.size())}));
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<uint8_t> in(std::max<int64_t>(longest, 1), 0);
  std::copy(mine.begin(), mine.end(), in.begin());
  std::vector<uint8_t> out(in.size() * group->size());
  CollectiveOptions o;
  o.timeout = kTimeout;
  o.async_op = false;  // Waited for at once: no comm-thread hand-offs.
  ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      group->AllGather(Buffer{in.data(), static_cast<int64_t>(in.size()),
                              DType::kU8, Device::Cpu()},
                       Buffer{out.data(), static_cast<int64_t>(out.size()),
                              DType::kU8, Device::Cpu()},
                       o));
  RETURN_IF_ERROR(work->Wait(kTimeout));
  std::vector<std::string> result;
  for (int r = 0; r < group->size(); ++r) {
    const char* begin =
        reinterpret_cast<const char*>(out.data()) + r * in.size();
    result.emplace_back(begin, begin + sizes[r]);
  }
  return result;
}

// Every rank's allocator statistics (current and peak per tag, totals).
absl::StatusOr<std::vector<MemoryStats>> GatherMemory(ProcessGroup* group) {
  const MemoryStats mine = GetAllocator(Device::Cpu())->Stats();
  std::vector<int64_t> v;
  for (int t = 0; t < kNumMemoryTags; ++t) v.push_back(mine.current[t]);
  for (int t = 0; t < kNumMemoryTags; ++t) v.push_back(mine.peak[t]);
  v.push_back(mine.total_current);
  v.push_back(mine.total_peak);
  v.push_back(mine.reserved_bytes);
  const size_t n = v.size();
  ASSIGN_OR_RETURN(std::vector<int64_t> all, AllGatherInts(group, v));
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

// The batch's ids and targets as i32 [batch, seq] tensors (one copy each).
absl::StatusOr<std::pair<Tensor, Tensor>> BatchTensors(const Batch& batch) {
  const Shape shape{batch.batch_size, batch.seq_len};
  ASSIGN_OR_RETURN(Tensor i, Tensor::Empty(shape, DType::kI32, Device::Cpu()));
  ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(shape, DType::kI32, Device::Cpu()));
  std::copy(batch.inputs.begin(), batch.inputs.end(), i.data<int32_t>());
  std::copy(batch.targets.begin(), batch.targets.end(), t.data<int32_t>());
  return std::make_pair(std::move(i), std::move(t));
}

// The model's FSDP plan by family; the units, root last.
absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyPlan(
    models::Transformer* model, const fsdp::FsdpPlanOptions& options) {
  switch (model->config().family) {
    case models::ModelFamily::kGpt2:
      return models::gpt2::ApplyFsdp(model, options);
    case models::ModelFamily::kLlama:
      return models::llama::ApplyFsdp(model, options);
  }
  return absl::InvalidArgumentError("unknown model family");
}

std::string TrainLine(const StepLog& s, int64_t steps, double tokens_per_s,
                      double mfu, double eta_s) {
  return absl::StrFormat(
      "step %*d/%d | loss %.4f | lr %.2e | gnorm %.3f | %s tok/s | MFU %.2f%% "
      "| %.0f ms/step | ETA %s",
      static_cast<int>(absl::StrCat(steps).size()), s.step, steps, s.loss, s.lr,
      s.grad_norm, absl::StrFormat("%.0f", tokens_per_s), 100.0 * mfu,
      1000.0 * s.step_s, FormatEta(eta_s));
}

}  // namespace

absl::StatusOr<TrainResult> Train(const TrainConfig& config,
                                  const TrainerEnv& env) {
  Printer print(env);
  TrainResult result;
  ASSIGN_OR_RETURN(ResolvedTrainConfig rc,
                   ResolveTrainConfig(config, env.world_size));
  const TrainingConfig& tc = config.training();
  const MetricsConfig& mc = config.metrics();

  // Mesh: {shard} or {replicate, shard} (HSDP).
  std::vector<MeshAxis> axes;
  if (rc.dp_replicate > 1) axes.push_back({"replicate", rc.dp_replicate});
  axes.push_back({"shard", rc.dp_shard});
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceMesh> mesh,
                   Context(DeviceMesh::Create(axes, env.rank, env.world_size,
                                              env.group_factory, "train"),
                           "trainer: creating the device mesh"));
  ASSIGN_OR_RETURN(ProcessGroup * world, mesh->FlatGroup());

  TraceRecorder trace(env.rank, absl::StrCat("rank ", env.rank));
  ScopedCurrentTrace trace_scope(&trace);

  // Data.
  ASSIGN_OR_RETURN(Dataset data, Context(LoadDataset(config.data()),
                                         "trainer: loading the data"));
  result.unigram_loss =
      UnigramLoss(*data.tokens, data.train.begin,
                  std::min(data.train.end, data.train.begin + kUnigramTokens));
  LoaderOptions lo;
  lo.seq_len = rc.seq_len;
  lo.batch_size = rc.micro_batch;
  lo.dp_rank = mesh->rank();
  lo.dp_world = env.world_size;
  lo.seed = tc.seed();
  lo.shuffle = config.data().shuffle();
  ASSIGN_OR_RETURN(
      std::unique_ptr<DataLoader> loader,
      Context(MakeLoader(data, data.train, lo), "trainer: the training split"));
  std::unique_ptr<DataLoader> val_loader;
  const ValidationConfig& vc = config.validation();
  if (vc.interval() > 0 && data.validation.size() > 0) {
    LoaderOptions vo = lo;
    vo.shuffle = false;
    ASSIGN_OR_RETURN(val_loader, Context(MakeLoader(data, data.validation, vo),
                                         "trainer: the validation split"));
  }

  // Model: meta -> plan -> sharded init.
  models::TransformerOptions mo;
  mo.activation_checkpointing = tc.activation_checkpointing();
  ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> model,
                   models::Transformer::Create(rc.model, mo));
  fsdp::FsdpPlanOptions plan;
  plan.shard.mesh = mesh.get();
  plan.shard.reshard_after_forward =
      config.parallelism().reshard_after_forward();
  plan.shard.hpz_degree = rc.hpz_degree > 1 ? rc.hpz_degree : 0;
  plan.shard.mp_policy.param_dtype = rc.param_dtype;
  plan.shard.mp_policy.reduce_dtype = rc.reduce_dtype;
  plan.shard.offload_policy.offload_params = config.parallelism().offload();
  ASSIGN_OR_RETURN(
      std::vector<fsdp::FsdpUnit*> units,
      Context(ApplyPlan(model.get(), plan), "trainer: applying the FSDP plan"));
  RETURN_IF_ERROR(fsdp::InitShardedWeights(model.get(), tc.seed()));
  std::vector<fsdp::ShardedParameter*> params =
      fsdp::ShardedParameters(model.get());
  std::vector<DTensor*> grads;
  std::vector<AdamWParam> adam_params;
  for (fsdp::ShardedParameter* sp : params) {
    grads.push_back(&sp->grad);
    adam_params.emplace_back(sp->name, &sp->master, &sp->grad);
  }
  AdamWOptions ao;
  ao.lr = tc.lr();
  ao.beta1 = tc.adam_beta1();
  ao.beta2 = tc.adam_beta2();
  ao.eps = tc.adam_eps();
  ao.weight_decay = tc.weight_decay();
  ao.decay_filter = DecayMatricesOnly;
  ASSIGN_OR_RETURN(AdamW adamw, AdamW::Create(std::move(adam_params), ao));
  RETURN_IF_ERROR(adamw.Init());
  std::optional<LossScaler> scaler;
  if (rc.param_dtype == DType::kF16) {
    LossScalerOptions lso;
    lso.init_scale = tc.initial_loss_scale();
    lso.growth_interval = tc.loss_scale_growth_interval();
    ASSIGN_OR_RETURN(LossScaler created, LossScaler::Create(lso));
    scaler.emplace(created);
  }
  LrScheduleOptions so;
  so.base_lr = tc.lr();
  so.warmup_steps = tc.warmup_steps();
  so.total_steps = tc.steps();
  so.min_lr_ratio = tc.min_lr_ratio();
  ASSIGN_OR_RETURN(so.decay, ParseDecay(tc.schedule()));
  ASSIGN_OR_RETURN(LrSchedule schedule, LrSchedule::Create(so));

  // Checkpoint state: views of the masters and the optimizer state, so
  // loads write in place.
  std::string step_bytes = "0", loader_bytes;
  StateDict state;
  for (fsdp::ShardedParameter* sp : params) {
    RETURN_IF_ERROR(state.AddDTensor("model/" + sp->name, sp->master));
  }
  ASSIGN_OR_RETURN(OptimizerStateDict osd, adamw.StateDict());
  for (auto& [name, t] : osd.tensors) {
    RETURN_IF_ERROR(state.AddDTensor("optim/" + name, t));
  }
  RETURN_IF_ERROR(state.AddBytes("train/step", "0"));
  RETURN_IF_ERROR(state.AddBytes("train/loader", ""));
  RETURN_IF_ERROR(state.AddBytes("train/loss_scaler", ""));
  RETURN_IF_ERROR(state.AddBytes("train/config", FormatTrainConfig(config)));
  const CheckpointConfig& cc = config.checkpoint();
  if (cc.resume() && !cc.folder().empty()) {
    absl::StatusOr<std::string> latest = LatestCheckpoint(cc.folder());
    if (latest.ok()) {
      ASSIGN_OR_RETURN(LoadResult loaded,
                       Context(Load(&state, *latest), "trainer: resuming"));
      ASSIGN_OR_RETURN(std::string steps_text, state.bytes("train/step"));
      int64_t done = 0;
      if (!absl::SimpleAtoi(steps_text, &done) || done < 0) {
        return absl::DataLossError(absl::StrCat(
            "trainer: ", *latest, ": train/step is not a step count: \"",
            steps_text, "\""));
      }
      ASSIGN_OR_RETURN(std::string ls, state.bytes("train/loader"));
      LoaderState loader_state;
      if (!loader_state.ParseFromString(ls)) {
        return absl::DataLossError(absl::StrCat(
            "trainer: ", *latest, ": train/loader does not parse"));
      }
      RETURN_IF_ERROR(
          Annotate(loader->Restore(loader_state),
                   absl::StrCat("trainer: resuming from ", *latest)));
      RETURN_IF_ERROR(adamw.SetStep(done));
      ASSIGN_OR_RETURN(std::string scaler_text,
                       state.bytes("train/loss_scaler"));
      if (scaler.has_value() && !scaler_text.empty()) {
        std::vector<std::string> parts = absl::StrSplit(scaler_text, ' ');
        float scale = 0;
        int64_t tracker = 0;
        if (parts.size() != 2 || !absl::SimpleAtof(parts[0], &scale) ||
            !absl::SimpleAtoi(parts[1], &tracker)) {
          return absl::DataLossError(
              absl::StrCat("trainer: ", *latest, ": train/loss_scaler \"",
                           scaler_text, "\" is not \"<scale> <tracker>\""));
        }
        RETURN_IF_ERROR(scaler->Restore(scale, tracker));
      }
      result.start_step = done;
      result.resumed_from = *latest;
    } else if (!absl::IsNotFound(latest.status())) {
      return latest.status();
    }
  }
  result.end_step = result.start_step;

  // Checkpoint writer.
  std::unique_ptr<AsyncSaver> async_saver;
  SaveOptions save_options;
  save_options.mesh = mesh.get();
  save_options.keep_last = cc.keep_latest_k();
  save_options.store_prefix = "fsdpp/trainer/checkpoint";
  if (cc.interval() > 0 && cc.async()) {
    if (env.store == nullptr && env.world_size > 1) {
      return absl::InvalidArgumentError(
          "trainer: checkpoint.async needs the rendezvous store");
    }
    save_options.store = env.store;
    ASSIGN_OR_RETURN(async_saver,
                     AsyncSaver::Create(cc.folder(), save_options));
  }
  auto save = [&](int64_t step) -> absl::Status {
    TraceSpan span("checkpoint", "checkpoint");
    RETURN_IF_ERROR(state.SetBytes("train/step", absl::StrCat(step)));
    RETURN_IF_ERROR(
        state.SetBytes("train/loader", loader->state().SerializeAsString()));
    RETURN_IF_ERROR(state.SetBytes(
        "train/loss_scaler", scaler.has_value()
                                 ? absl::StrFormat("%.9g %d", scaler->scale(),
                                                   scaler->growth_tracker())
                                 : ""));
    if (async_saver != nullptr) {
      ASSIGN_OR_RETURN(std::shared_ptr<PendingSave> pending,
                       async_saver->Save(state, step));
      result.last_checkpoint =
          absl::StrCat(cc.folder(), "/", CheckpointDirName(step));
      print.Line(absl::StrFormat(
          "checkpoint: step %d saving in the background to %s (blocked "
          "%.0f ms)",
          step, result.last_checkpoint,
          absl::ToDoubleMilliseconds(pending->blocking_time())));
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(SaveResult saved,
                     Save(state, cc.folder(), step, save_options));
    result.last_checkpoint = saved.path;
    print.Line(
        absl::StrFormat("checkpoint: step %d saved to %s (%.1f MiB in %.2f s)",
                        step, saved.path, saved.total_bytes / 1048576.0,
                        absl::ToDoubleSeconds(saved.total_time)));
    return absl::OkStatus();
  };

  // Metrics.
  std::unique_ptr<JsonlWriter> jsonl;
  if (env.rank == 0 && !mc.jsonl_path().empty()) {
    ASSIGN_OR_RETURN(jsonl, JsonlWriter::Open(mc.jsonl_path()));
  }
  const double flops_per_token = models::FlopsPerToken(rc.model, rc.seq_len);
  double peak = mc.peak_tflops() * 1e12;
  std::string peak_source = "metrics.peak_tflops";
  if (peak <= 0) {
    ASSIGN_OR_RETURN(
        peak, MeasureMatmulFlops(
                  rc.param_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32,
                  kPeakMatmulN, kPeakBudget));
    // The slowest rank's number: all ranks share the machine.
    std::vector<double> p = {-peak};
    RETURN_IF_ERROR(AllReduce(world, &p, ReduceOp::kMax));
    peak = -p[0];
    peak_source = absl::StrFormat(
        "measured: %d^3 %s matmul, all ranks at once", kPeakMatmulN,
        DTypeName(rc.param_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32));
  }
  result.peak_tflops_per_rank = peak / 1e12;
  const int64_t num_params = models::NumParameters(rc.model);

  print.Line(absl::StrFormat(
      "fsdpp trainer: %s (%s parameters) on %d rank(s), mesh %s, %s\n"
      "  data: %s\n"
      "  batch: %d sequences x %d tokens = %d tokens/step (micro batch %d, "
      "%d accumulation step(s))\n"
      "  unigram baseline loss: %.4f nats (the loss of predicting token "
      "frequencies)\n"
      "  MFU peak: %.3f TFLOP/s per rank (%s); %.3g model FLOPs per token",
      config.model().name(), absl::StrFormat("%.2fM", num_params / 1e6),
      env.world_size, mesh->ToString(),
      plan.shard.reshard_after_forward ? "ZeRO-3" : "ZeRO-2", data.description,
      tc.global_batch(), rc.seq_len, rc.tokens_per_step, rc.micro_batch,
      rc.grad_accumulation_steps, result.unigram_loss,
      result.peak_tflops_per_rank, peak_source, flops_per_token));
  if (!result.resumed_from.empty()) {
    print.Line(absl::StrFormat("resumed from %s: %d step(s) done",
                               result.resumed_from, result.start_step));
  }
  if (jsonl != nullptr) {
    RETURN_IF_ERROR(jsonl->Write(absl::StrCat(
        "{\"kind\":\"run\",\"model\":", JsonQuote(config.model().name()),
        ",\"world_size\":", env.world_size, ",\"params\":", num_params,
        ",\"tokens_per_step\":", rc.tokens_per_step, ",\"steps\":", tc.steps(),
        ",\"start_step\":", result.start_step,
        ",\"unigram_loss\":", JsonNumber(result.unigram_loss),
        ",\"peak_tflops_per_rank\":", JsonNumber(result.peak_tflops_per_rank),
        ",\"flops_per_token\":", JsonNumber(flops_per_token), "}")));
  }
  {
    ASSIGN_OR_RETURN(std::vector<MemoryStats> mem, GatherMemory(world));
    print.Line(FormatMemoryTable(mem,
                                 "Memory per rank at start (sharded state "
                                 "allocated, before the first step):"));
  }

  // Validation.
  auto validate = [&](int64_t step) -> absl::Status {
    TraceSpan span("validation", "compute");
    val_loader->Reset();
    double sum = 0;
    for (int64_t b = 0; b < vc.batches(); ++b) {
      ASSIGN_OR_RETURN(auto tensors, BatchTensors(val_loader->Next()));
      ASSIGN_OR_RETURN(float l, model->EvalLoss(tensors.first, tensors.second));
      sum += l;
    }
    // Free what the forward-only passes left gathered (the next training
    // forward would, but the memory between now and then is not needed).
    for (fsdp::FsdpUnit* unit : units) RETURN_IF_ERROR(unit->Reshard());
    std::vector<double> v = {sum / vc.batches()};
    RETURN_IF_ERROR(AllReduce(world, &v, ReduceOp::kAvg));
    result.validation.emplace_back(step, v[0]);
    print.Line(
        absl::StrFormat("validation: step %d loss %.4f (%d batches x %d "
                        "rank(s))",
                        step, v[0], vc.batches(), env.world_size));
    if (jsonl != nullptr) {
      RETURN_IF_ERROR(
          jsonl->Write(absl::StrCat("{\"kind\":\"val\",\"step\":", step,
                                    ",\"val_loss\":", JsonNumber(v[0]), "}")));
    }
    return absl::OkStatus();
  };

  // The loop.
  ThroughputMeter meter;
  const int64_t accumulation = rc.grad_accumulation_steps;
  const float backward_scale = 1.0f / static_cast<float>(accumulation);
  const absl::Time run_start = absl::Now();
  int64_t comm_wait_us = 0, comm_steps = 0;
  const int64_t trace_begin = mc.trace_start_step(),
                trace_end = mc.trace_start_step() + mc.trace_steps();
  for (int64_t step = result.start_step + 1; step <= tc.steps(); ++step) {
    if (env.stop_after_steps > 0 &&
        step > result.start_step + env.stop_after_steps) {
      if (async_saver != nullptr) RETURN_IF_ERROR(async_saver->Wait());
      print.Line(absl::StrFormat("stopping after step %d (stop_after_steps)",
                                 step - 1));
      return result;
    }
    const bool tracing =
        mc.trace_steps() > 0 && step >= trace_begin && step < trace_end;
    trace.SetRecording(tracing);
    const int64_t wait_before = trace.TotalMicros("comm_wait");
    const absl::Time t0 = absl::Now();
    StepLog log;
    log.step = step;
    if (scaler.has_value()) log.loss_scale = scaler->scale();
    {
      TraceSpan step_span("step", "step");
      RETURN_IF_ERROR(ZeroGrad(grads));
      double loss = 0;
      for (int64_t m = 0; m < accumulation; ++m) {
        Batch batch;
        {
          TraceSpan s("data", "data");
          batch = loader->Next();
        }
        ASSIGN_OR_RETURN(auto tensors, BatchTensors(batch));
        float l = 0;
        {
          TraceSpan s("forward", "compute");
          ASSIGN_OR_RETURN(
              l, Context(model->ForwardLoss(tensors.first, tensors.second),
                         absl::StrCat("step ", step, " forward")));
        }
        {
          TraceSpan s("backward", "compute");
          RETURN_IF_ERROR(
              Annotate(model->Backward(backward_scale *
                                       static_cast<float>(log.loss_scale)),
                       absl::StrCat("step ", step, " backward")));
        }
        loss += static_cast<double>(l) / accumulation;
      }
      std::vector<double> v = {loss};
      RETURN_IF_ERROR(AllReduce(world, &v, ReduceOp::kAvg));
      log.loss = v[0];
      if (!std::isfinite(log.loss)) {
        return absl::InternalError(absl::StrFormat(
            "step %d: the loss is %f; stopping before the optimizer step. "
            "Nothing was saved after step %d%s. Lower training.lr or "
            "enable clipping and resume.",
            step, log.loss, step - 1,
            result.last_checkpoint.empty()
                ? ""
                : absl::StrCat("; the latest checkpoint is ",
                               result.last_checkpoint)));
      }
      if (scaler.has_value()) {
        TraceSpan s("unscale", "optimizer");
        ASSIGN_OR_RETURN(bool finite, scaler->UnscaleAndCheck(grads, kTimeout));
        scaler->Update(!finite);
        log.skipped = !finite;
      }
      if (log.skipped) {
        log.grad_norm = std::numeric_limits<double>::quiet_NaN();
        print.Line(absl::StrFormat(
            "step %d: gradients overflowed at loss scale %g; optimizer step "
            "skipped, scale now %g",
            step, log.loss_scale, scaler->scale()));
      } else {
        {
          TraceSpan s("clip", "optimizer");
          const double max_norm =
              tc.grad_clip() > 0
                  ? tc.grad_clip()
                  : std::numeric_limits<double>::max();  // Measure only.
          ASSIGN_OR_RETURN(log.grad_norm,
                           ClipGradNorm(grads, max_norm, kTimeout));
        }
        if (!std::isfinite(log.grad_norm)) {
          return absl::InternalError(absl::StrFormat(
              "step %d: the gradient norm is %f (loss %.4f); stopping before "
              "the optimizer step. Nothing was saved after step %d.",
              step, log.grad_norm, log.loss, step - 1));
        }
        {
          TraceSpan s("optimizer", "optimizer");
          log.lr = schedule.LrAt(adamw.step());
          RETURN_IF_ERROR(adamw.SetLr(log.lr));
          RETURN_IF_ERROR(adamw.Step());
        }
      }  // Not skipped.
    }
    log.step_s = absl::ToDoubleSeconds(absl::Now() - t0);
    result.steps.push_back(log);
    result.end_step = step;
    const bool warmup =
        step - result.start_step <= mc.throughput_warmup_steps() &&
        step < tc.steps();
    meter.Add(log.step_s, rc.tokens_per_step, warmup);
    if (!warmup) {
      comm_wait_us += trace.TotalMicros("comm_wait") - wait_before;
      ++comm_steps;
    }

    // Log.
    const double tps_now = rc.tokens_per_step / std::max(log.step_s, 1e-9);
    const double mfu_now =
        flops_per_token * tps_now / env.world_size / std::max(peak, 1.0);
    const bool log_now = step % mc.log_interval() == 0 || step == tc.steps() ||
                         step == result.start_step + 1;
    const double eta = meter.mean_step_s() * (tc.steps() - step);
    print.Progress(
        TrainLine(log, tc.steps(),
                  meter.measured_steps() > 0 ? meter.tokens_per_s() : tps_now,
                  meter.measured_steps() > 0
                      ? flops_per_token * meter.tokens_per_s() /
                            env.world_size / std::max(peak, 1.0)
                      : mfu_now,
                  eta),
        log_now);
    if (jsonl != nullptr && log_now) {
      RETURN_IF_ERROR(jsonl->Write(absl::StrCat(
          "{\"kind\":\"train\",\"step\":", step,
          ",\"loss\":", JsonNumber(log.loss), ",\"lr\":", JsonNumber(log.lr),
          ",\"grad_norm\":", JsonNumber(log.grad_norm),
          ",\"tokens_per_s\":", JsonNumber(tps_now),
          ",\"tokens_per_s_per_rank\":", JsonNumber(tps_now / env.world_size),
          ",\"tflops_per_rank\":",
          JsonNumber(flops_per_token * tps_now / env.world_size / 1e12),
          ",\"mfu\":", JsonNumber(mfu_now),
          ",\"step_time_s\":", JsonNumber(log.step_s), ",\"exposed_comm_s\":",
          JsonNumber((trace.TotalMicros("comm_wait") - wait_before) / 1e6),
          ",\"elapsed_s\":",
          JsonNumber(absl::ToDoubleSeconds(absl::Now() - run_start)),
          ",\"warmup\":", warmup ? "true" : "false",
          scaler.has_value()
              ? absl::StrCat(",\"loss_scale\":", JsonNumber(log.loss_scale),
                             ",\"skipped\":", log.skipped ? "true" : "false")
              : "",
          "}")));
    }

    if (val_loader != nullptr &&
        (step % vc.interval() == 0 || step == tc.steps())) {
      RETURN_IF_ERROR(validate(step));
    }
    if (cc.interval() > 0 &&
        (step % cc.interval() == 0 || step == tc.steps())) {
      RETURN_IF_ERROR(save(step));
    }
    if (mc.trace_steps() > 0 &&
        step == std::min(trace_end, tc.steps() + 1) - 1 &&
        step >= trace_begin) {
      trace.SetRecording(false);
      ASSIGN_OR_RETURN(std::vector<std::string> pieces,
                       AllGatherStrings(world, trace.EventsJson()));
      trace.ClearEvents();
      if (env.rank == 0) {
        RETURN_IF_ERROR(
            WriteTraceFile(mc.trace_path(), ChromeTraceJson(pieces)));
        print.Line(absl::StrFormat(
            "trace: steps %d-%d of every rank written to %s (open in "
            "https://ui.perfetto.dev)",
            trace_begin, step, mc.trace_path()));
      }
    }
  }
  trace.SetRecording(false);
  if (async_saver != nullptr) {
    RETURN_IF_ERROR(
        Annotate(async_saver->Wait(), "trainer: the last checkpoint"));
  }
  // Old checkpoints dropped by keep_latest_k are deleted in the background;
  // finish before the process may exit.
  RETURN_IF_ERROR(WaitForCheckpointCleanup());

  // Summary.
  result.tokens_per_s = meter.tokens_per_s();
  result.tokens_per_s_per_rank = result.tokens_per_s / env.world_size;
  result.tflops_per_rank =
      flops_per_token * result.tokens_per_s_per_rank / 1e12;
  result.mfu = peak > 0 ? result.tflops_per_rank * 1e12 / peak : 0;
  result.exposed_comm_s_per_step =
      comm_steps > 0 ? comm_wait_us / 1e6 / comm_steps : 0;
  result.memory = GetAllocator(Device::Cpu())->Stats();
  ASSIGN_OR_RETURN(std::vector<MemoryStats> mem, GatherMemory(world));
  std::vector<double> comm = {result.exposed_comm_s_per_step};
  RETURN_IF_ERROR(AllReduce(world, &comm, ReduceOp::kMax));
  if (!result.steps.empty()) {
    const StepLog& last = result.steps.back();
    print.Line(FormatMemoryTable(mem, "Memory per rank at the end:"));
    print.Line(absl::StrFormat(
        "Results (steps %d-%d, %d warm-up step(s) excluded from throughput):\n"
        "  Loss:              %.4f (unigram baseline %.4f)%s\n"
        "  Time/step:         %.3f s\n"
        "  Tokens/sec:        %.0f\n"
        "  Tokens/sec/rank:   %.0f\n"
        "  TFLOP/s per rank:  %.4f\n"
        "  Peak per rank:     %.4f TFLOP/s\n"
        "  MFU:               %.2f%%\n"
        "  Exposed comm/step: %.1f ms (slowest rank)\n"
        "  Peak memory/rank:  %.1f MiB",
        result.start_step + 1, result.end_step,
        std::min<int64_t>(mc.throughput_warmup_steps(),
                          result.end_step - result.start_step - 1),
        last.loss, result.unigram_loss,
        result.validation.empty()
            ? ""
            : absl::StrFormat("; validation %.4f",
                              result.validation.back().second),
        meter.mean_step_s(), result.tokens_per_s, result.tokens_per_s_per_rank,
        result.tflops_per_rank, result.peak_tflops_per_rank, 100 * result.mfu,
        1000 * comm[0],
        std::max_element(
            mem.begin(), mem.end(),
            [](const MemoryStats& a, const MemoryStats& b) {
              return a.total_peak < b.total_peak;
            })->total_peak /
            1048576.0));
    if (jsonl != nullptr) {
      RETURN_IF_ERROR(jsonl->Write(absl::StrCat(
          "{\"kind\":\"summary\",\"steps\":", result.end_step,
          ",\"loss\":", JsonNumber(last.loss), ",\"val_loss\":",
          JsonNumber(result.validation.empty()
                         ? std::numeric_limits<double>::quiet_NaN()
                         : result.validation.back().second),
          ",\"tokens_per_s\":", JsonNumber(result.tokens_per_s),
          ",\"tokens_per_s_per_rank\":",
          JsonNumber(result.tokens_per_s_per_rank),
          ",\"tflops_per_rank\":", JsonNumber(result.tflops_per_rank),
          ",\"mfu\":", JsonNumber(result.mfu),
          ",\"exposed_comm_s_per_step\":", JsonNumber(comm[0]), "}")));
    }
  } else {
    print.Line(absl::StrFormat("nothing to do: %d of %d steps already done",
                               result.start_step, tc.steps()));
  }
  return result;
}

}  // namespace trainer
}  // namespace fsdpp
