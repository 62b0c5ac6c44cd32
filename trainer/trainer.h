// The training loop: a Trainer trains one rank's share of a TrainConfig run.
//
//   config -> its layout (recipe/layout.h) -> the memory plan (the run's
//   recipe dry-run on meta tensors, plan/) -> the mesh, the data -> the
//   recipe's build (recipe/training.h: the model or this rank's pipeline
//   stages with the family's tensor-parallel and FSDP plans, sharded
//   initialisation -- the same weights at any world size -- and AdamW on
//   the sharded fp32 masters) -> resume from the latest checkpoint -> for
//   each step, the recipe's step (micro-batches with 1/accumulation folded
//   into the loss gradient, gradients reduce-scattered by FSDP, the loss
//   averaged over ranks; then the gradient-norm clip, the schedule's LR and
//   AdamW); periodic validation, logging and checkpoints.
//
// Every rank creates a Trainer with the same config and runs it
// (Trainer::Create(config, env), then Run(), or the loop's parts one by
// one); rank 0 prints. Ranks may be processes (trainer/train_main.cc, through
// tools/launch) or threads of one process (the tests): everything
// rank-specific goes through `TrainerEnv`. The trainer knows no parallelism
// of its own: pipeline, tensor and data parallelism are the recipe's.
//
// Failure semantics: a non-finite loss or gradient norm (the same on every
// rank: both are reduced first) stops the run before the optimizer step,
// with an error naming the step; nothing is saved after it, so the latest
// checkpoint stays the last good state. A failed asynchronous checkpoint
// stops the run on every rank before the next step (DataLoss naming the
// save's step and the latest committed checkpoint): work never goes on
// unprotected. Every collective has a timeout.
//
// With f16 parameters a dynamic loss scaler (optim/loss_scaler.h) scales
// the backward; a step whose gradients overflow on any rank is skipped (the
// optimizer and the schedule do not advance) and the scale halves.
//
// Checkpoints (checkpoint/checkpoint.h) hold "model/<fqn>" (sharded fp32
// masters), "optim/<fqn>.exp_avg|.exp_avg_sq" (sharded), "train/step" (steps
// done), "train/loader" (the data position, the same on every rank),
// "train/loss_scaler" ("<scale> <growth tracker>", empty without f16),
// "train/config" (the run's config, for inspection) and "train/model" (the
// resolved model config, for tools that rebuild the model from the
// checkpoint alone). Names are the whole model's on every layout (a
// pipeline rank holds its stages' keys; the others are the other stages'),
// so a checkpoint resumes at any world size, mesh or pipeline split; at the
// same layout it reproduces the uninterrupted run bitwise, at another within
// the data-parallel parity tolerance (the loader position is global).
#ifndef FSDPP_TRAINER_TRAINER_H_
#define FSDPP_TRAINER_TRAINER_H_

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/training/training_state.h"
#include "comm/process_group.h"
#include "comm/store.h"
#include "core/allocator.h"
#include "core/trace.h"
#include "mesh/device_mesh.h"
#include "models/transformer.h"
#include "optim/loss_scaler.h"
#include "optim/lr_schedule.h"
#include "recipe/step/step.h"
#include "recipe/training.h"
#include "trainer/config.h"
#include "trainer/config.pb.h"
#include "trainer/data/loader.h"
#include "trainer/dataset.h"
#include "trainer/metrics.h"

namespace fsdpp {
namespace trainer {

// Who this rank is and how it talks to the others.
struct TrainerEnv {
  int rank = 0;
  int world_size = 1;
  // Where this rank computes: the CPU, or its GPU (cuda:LOCAL_RANK, made
  // current by the caller: core/gpus.h UseGpu).
  Device device = Device::Cpu();
  // Makes the mesh's process groups (e.g. GlooGroupFactory over the
  // rendezvous store; NcclGroupFactory on a GPU).
  ProcessGroupFactory group_factory;
  // Makes the groups of the trainer's own host values (the loss, timings,
  // memory tables, the checkpoint coordinator) when the mesh's take device
  // buffers only (NCCL: a GlooGroupFactory over the same store); empty:
  // the mesh's own groups.
  ProcessGroupFactory host_group_factory;
  // Coordinates asynchronous checkpoints (required for checkpoint.async with
  // more than one rank; not owned).
  Store* store = nullptr;
  // Rank 0's output (the other ranks print nothing but errors).
  std::FILE* out = stdout;
  // How rank 0 shows its progress line (step, loss, lr, tok/s, MFU, ETA).
  enum class Progress {
    kLines,        // A plain line every metrics.log_interval steps.
    kTerminal,     // `out` is a terminal: redrawn in place every step.
    kStatusLines,  // Every step as a launcher status line ("\r" + text +
                   // "\n", runtime/launch.h), which the launcher draws
                   // in place on its terminal.
  };
  Progress progress = Progress::kLines;
  // Preemption drills and tests: stop after this many steps of this run
  // (0 = run to training.steps), as if the job had been killed there: no
  // validation, checkpoint or summary beyond what the steps before did.
  int64_t stop_after_steps = 0;
  // The job this rank belongs to (the launcher's FSDPP_JOB_ID; empty: a new
  // one). Rank 0's is recorded in every checkpoint as `train/job`.
  std::string job_id;
  // The launcher started this job's ranks before (a restart or a new elastic
  // round): resume from this job's latest committed checkpoint whatever
  // checkpoint.resume says, never from another run's.
  bool restarted = false;
  // Keep each step's loss and gradient norm on the device and read them
  // only at logged steps, before a save and at the end
  // (recipe::BuildOptions::step_values_on_device), so that a GPU step never
  // waits for the GPU. Unset: on a GPU. Where the step cannot (pipeline
  // parallelism, f16, offload) the values are read every step.
  std::optional<bool> step_values_on_device;
};

// One optimizer step as logged.
struct StepLog {
  int64_t step = 0;      // 1-based
  double loss = 0;       // mean over the global batch
  double lr = 0;         // used by this step
  double grad_norm = 0;  // before clipping (NaN when skipped)
  double step_s = 0;
  // f16: the loss scale the step's backward used, and whether its gradients
  // overflowed so that the optimizer step was skipped (GradScaler).
  double loss_scale = 1;
  bool skipped = false;
  int64_t host_syncs = 0;  // the host's blocking waits on a GPU (device_wait.h)
  // A mixture of experts (model.moe): the auxiliary loss (summed over the
  // MoE layers of this rank's pipeline stage, averaged over the
  // micro-batches and, once logged, the data-parallel ranks; NaN for a
  // dense model) and the tokens each expert received (summed over those
  // layers; once logged, over the data-parallel ranks).
  double aux_loss = std::nan("");
  std::vector<int64_t> expert_tokens;
};

// What a run did, as this rank saw it (the logged numbers are global).
struct TrainResult {
  int64_t start_step = 0;  // steps already done when the run started
  int64_t end_step = 0;    // steps done when it stopped
  std::vector<StepLog> steps;
  // (step, mean validation loss over validation.batches per rank).
  std::vector<std::pair<int64_t, double>> validation;
  double unigram_loss = 0;  // nats, on the training split
  double tokens_per_s = 0;  // global, warm-up excluded
  double tokens_per_s_per_rank = 0;
  double tflops_per_rank = 0;
  double peak_tflops_per_rank = 0;
  double mfu = 0;                      // fraction
  double exposed_comm_s_per_step = 0;  // waits for collectives, this rank
  std::string resumed_from;            // checkpoint directory, or empty
  std::string last_checkpoint;         // directory of the last save, or empty
  MemoryStats memory;                  // this rank's allocator at the end
  // Pipeline parallelism (pp > 1), this rank over the measured steps: the
  // fraction of its pipeline time spent waiting for activations and
  // gradients (the bubble, transfers included), the bubble the schedule
  // gives with equal stage times, and the most bytes held for backward at
  // once (the stashed activations of the micro-batches in flight).
  double pipeline_bubble = 0;
  double pipeline_bubble_schedule = 0;
  int64_t pipeline_peak_held_bytes = 0;
};

// One rank's share of a TrainConfig run, in torchtitan's shape: Create
// builds everything (mesh, data, model and FSDP plan, optimizer, schedule,
// loss scaler, checkpoint state and resume, metrics) and prints the run's
// header; Run is the loop. The loop's parts are public so that a test (or
// another driver) can take the run step by step, in Run's order:
//
//   while (!trainer->done()) {
//     TrainStep(); LogStep(); if (ValidationDue()) Validate();
//     MaybeSave(); MaybeWriteTrace();
//   }
//   Summarize();
//
// Every rank makes the same calls in the same order (most of them run
// collectives). A Trainer installs its trace recorder as the current one of
// the thread that creates it: use and destroy it on that thread.
class Trainer {
 public:
  // Builds this rank's trainer for `config` (paths as given: make them
  // absolute first if needed), resuming from the latest checkpoint when
  // configured. InvalidArgument for a config that does not validate at
  // env.world_size; the errors of the layers below, annotated with the stage
  // (data, model, checkpoint).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const TrainConfig& config, const TrainerEnv& env);

  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains from the current step to training.steps (or env.stop_after_steps
  // steps), validating, saving and tracing on their intervals, then
  // summarizes. Errors name the step. Call once, instead of the parts below.
  absl::StatusOr<TrainResult> Run();

  // One optimizer step, the (step() + 1)-th: the micro-batches' forward and
  // backward, the loss averaged over the ranks, unscaling (f16), clipping,
  // the schedule and AdamW. Appends its StepLog to result(). Internal error
  // for a non-finite loss or gradient norm (before the optimizer step);
  // DataLoss when the asynchronous checkpoint in flight failed on any rank
  // (before anything of the step); FailedPrecondition when done().
  // With the step values on the device (TrainerEnv::step_values_on_device)
  // the loss and norm are NaN in result() until LogStep reads them, and a
  // non-finite one is found there: AdamW skipped that step on the device.
  absl::Status TrainStep();
  // Prints (rank 0) and writes to the metrics JSONL the last step's line.
  // With the step values on the device, first reads those of the steps
  // since the last read when this step is logged (metrics.log_interval, the
  // first and last), checkpointed, the last of the throughput warm-up (so
  // the measured steps start with the GPU caught up), the end of a
  // stop_after_steps run, or when recipe::Training::kMaxPendingSteps are
  // waiting; Internal error naming the first step whose loss or gradient
  // norm was not finite.
  absl::Status LogStep();
  // Whether Run validates after the current step (validation.interval, and
  // the last step).
  bool ValidationDue() const;
  // Mean loss over validation.batches per rank, averaged over the ranks, at
  // the current step: appended to result().validation, printed and logged.
  // FailedPrecondition when the run has no validation split or interval.
  absl::Status Validate();
  // Saves a checkpoint of the current step when checkpoint.interval says so
  // (and after the last step); nothing before the first step of this run.
  absl::Status MaybeSave();
  // Writes the Chrome trace of the metrics.trace_* window when the current
  // step is its last.
  absl::Status MaybeWriteTrace();
  // The first step metrics.profile_steps profiles: the first after the
  // throughput warm-up (or the run's last, in a shorter run).
  int64_t ProfileBegin() const;
  // Prints (rank 0) and logs the op table when the current step is the
  // profile's last.
  absl::Status MaybeReportProfile();
  // Ends the run: waits for background checkpoint writes and deletions,
  // fills result()'s throughput, MFU, communication and memory numbers and
  // prints (rank 0) and logs the results. Call once, after the last step.
  absl::Status Summarize();

  // Steps done (by this run and the checkpoint it resumed from).
  int64_t step() const { return result_.end_step; }
  // Whether step() reached training.steps.
  bool done() const;
  // What the run did so far.
  const TrainResult& result() const { return result_; }

 private:
  class Printer;  // Rank 0's output (trainer.cc).

  Trainer(const TrainConfig& config, const TrainerEnv& env,
          ResolvedTrainConfig rc);

  // Create's sections, in order.
  absl::Status BuildMesh();
  absl::Status BuildData();
  // The recipe's build (the model or this rank's stages, AdamW).
  absl::Status BuildModel();
  // model.init_from: the HF directory's weights into the recipe's models
  // (the whole model, or this rank's pipeline stage parts), each rank
  // reading its shards only, then model.lora.init_from's adapters; sets
  // init_note_.
  absl::Status InitFromHf();
  // InitFromHf's first part: the base weights.
  absl::Status InitFromHfBase();
  // The loss scaler (f16) and the LR schedule.
  absl::Status BuildOptimizer();
  absl::Status BuildCheckpointState();
  // Loads the checkpoint directory `latest` into the state (in place), the
  // loader, the optimizer's step count and the loss scaler.
  absl::Status Resume(const std::string& latest);
  // checkpoint.resume=false: a restarted job resumes its own latest
  // checkpoint (train/job equal to this run's), never another run's; a
  // fresh one starts at step 0 and says what the folder already holds.
  absl::Status ResumeOwnCheckpoint();
  // After a non-strict load: every key of this rank's state was there, and
  // the checkpoint's others are the model's (a pipeline rank holds only its
  // stages').
  absl::Status CheckLoadedKeys(const LoadResult& loaded) const;
  // Where the frozen parameters' values come from ("hf:DIR" or "seed N").
  std::string FrozenSource() const;
  // Resuming: the checkpoint's frozen parameters (`record`) are this
  // run's, from the same source; FailedPrecondition saying what differs.
  absl::Status CheckFrozen(const std::string& dir,
                           const FrozenRecord& record) const;
  absl::Status BuildCheckpointWriter();
  absl::Status BuildMetrics();
  absl::Status PrintHeader(const std::string& peak_source);
  absl::Status CheckMemoryPlan();
  void ReportMemory(const std::string& when) const;

  // TrainStep's optimizer part: unscale (f16), clip, the LR, AdamW.
  absl::Status OptimizerStep(StepLog* log);
  // Whether a checkpoint is due after the current step.
  bool SaveDue() const;
  // What a stop at non-finite `bad_step` says was saved and what to do (not
  // "resume" when the step is the first after resuming: the checkpoint may
  // be the cause).
  std::string DivergenceAdvice(int64_t bad_step) const;
  // Reads the step values kept on the device into result().steps (nothing
  // when none wait); Internal error for the first step not applied.
  absl::Status ReadStepValues();
  // DataLoss on every rank when the asynchronous save in flight failed on
  // any: the run stops before `step` instead of training on unprotected.
  absl::Status CheckPendingSave(int64_t step);
  // Saves the current step.
  absl::Status Save();
  // Prints and logs the results block (Summarize, when steps were taken).
  absl::Status PrintResults(const std::vector<MemoryStats>& mem,
                            double exposed_comm_s);

  const TrainConfig config_;
  const TrainerEnv env_;
  const ResolvedTrainConfig rc_;
  std::unique_ptr<Printer> print_;
  TrainResult result_;

  // Mesh and trace. The host mesh carries the trainer's host values (the
  // mesh itself when its groups take host buffers).
  std::unique_ptr<DeviceMesh> mesh_;
  std::unique_ptr<DeviceMesh> host_mesh_;  // null: mesh_
  ProcessGroup* world_ = nullptr;          // The host mesh's flat group.
  // The data-parallel ranks' flat group of the host mesh
  // (Training::data_group: a MoE model's stats are summed over it); null for
  // a dense model.
  ProcessGroup* data_group_ = nullptr;
  std::unique_ptr<TraceRecorder> trace_;
  std::optional<ScopedCurrentTrace> trace_scope_;
  // metrics.profile_steps: the spans of the profiled steps and their time.
  OpProfile op_profile_;
  int64_t profiled_ns_ = 0, profiled_steps_ = 0;
  // Data.
  Dataset data_;
  std::unique_ptr<DataLoader> loader_;
  std::unique_ptr<DataLoader> val_loader_;  // Null without validation.
  // What this rank trains and its step (the recipe), the loss scaler (f16
  // only) and the LR schedule.
  std::unique_ptr<recipe::Training> training_;
  // What model.init_from loaded (printed with the run's header).
  std::string init_note_;
  // The model's parameters as the layout trains them (counted once, at the
  // build) and what checkpoints record of the frozen ones (empty when
  // nothing is frozen).
  recipe::Layout::ParameterCounts counts_;
  FrozenRecord frozen_;
  // The memory plan's header line, and its peak of live bytes (0: none).
  std::string plan_note_;
  std::string plan_summary_;  // for the memory report
  int64_t plan_peak_bytes_ = 0;
  std::optional<LossScaler> scaler_;
  std::optional<LrSchedule> schedule_;
  // The step's own accounting (pipeline waits), over the measured steps.
  recipe::Training::Totals step_totals_;
  recipe::StepLoss last_step_;
  // Checkpoints: views of the masters and the optimizer state.
  StateDict state_;
  // What resuming found, for the header: skipped directories, or none.
  std::vector<std::string> resume_notes_;
  // This run's job identity (rank 0's), saved as train/job.
  std::string job_;
  SaveOptions save_options_;
  std::unique_ptr<AsyncSaver> async_saver_;
  // The asynchronous save in flight until every rank committed it; checked
  // before each step (CheckPendingSave).
  std::shared_ptr<PendingSave> pending_save_;
  // Metrics.
  std::unique_ptr<JsonlWriter> jsonl_;  // Rank 0 with a jsonl_path only.
  double flops_per_token_ = 0;
  double peak_ = 0;  // FLOP/s per rank.
  // The loop's running numbers.
  ThroughputMeter meter_;
  absl::Time run_start_;
  int64_t comm_wait_us_ = 0;  // Over the steps after the warm-up.
  int64_t comm_steps_ = 0;
  // The last step's comm_wait total before it, and whether it was warm-up.
  int64_t wait_before_ = 0;
  bool warmup_ = false;
  // When the last step began, and the host syncs before it.
  absl::Time step_start_;
  int64_t syncs_before_ = 0;
  int64_t host_syncs_ = 0;  // Over this run's steps (LogStep).
};

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_TRAINER_H_
