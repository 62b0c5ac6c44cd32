// The training loop: one call trains one rank's share of a TrainConfig run.
//
//   meta model -> the model family's FSDP plan (models/<family>/parallelize)
//   -> sharded initialisation (the same weights at any world size) -> AdamW
//   on the sharded fp32 masters -> resume from the latest checkpoint -> for
//   each step: micro-batches (forward, backward with 1/accumulation folded
//   into the loss gradient; gradients reduce-scattered by FSDP), loss
//   averaged over ranks, gradient-norm clip, schedule, AdamW step; periodic
//   validation, logging and checkpoints.
//
// Every rank calls Train with the same config; rank 0 prints. Ranks may be
// processes (trainer/train_main.cc, through tools/launch) or threads of one
// process (the tests): everything rank-specific goes through `TrainerEnv`.
//
// Failure semantics: a non-finite loss or gradient norm (the same on every
// rank: both are reduced first) stops the run before the optimizer step,
// with an error naming the step; nothing is saved after it, so the latest
// checkpoint stays the last good state. Every collective has a timeout.
//
// With f16 parameters a dynamic loss scaler (optim/loss_scaler.h) scales
// the backward; a step whose gradients overflow on any rank is skipped (the
// optimizer and the schedule do not advance) and the scale halves.
//
// Checkpoints (checkpoint/checkpoint.h) hold "model/<fqn>" (sharded fp32
// masters), "optim/<fqn>.exp_avg|.exp_avg_sq" (sharded), "train/step" (steps
// done), "train/loader" (the data position, the same on every rank),
// "train/loss_scaler" ("<scale> <growth tracker>", empty without f16) and
// "train/config" (the run's config, for inspection). Resuming at the same
// world size reproduces the uninterrupted run bitwise; at another world size
// within the data-parallel parity tolerance (the loader position is global).
#ifndef FSDPP_TRAINER_TRAINER_H_
#define FSDPP_TRAINER_TRAINER_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "comm/store.h"
#include "core/allocator.h"
#include "trainer/config.pb.h"

namespace fsdpp {
namespace trainer {

// Who this rank is and how it talks to the others.
struct TrainerEnv {
  int rank = 0;
  int world_size = 1;
  // Makes the mesh's process groups (e.g. GlooGroupFactory over the
  // rendezvous store).
  ProcessGroupFactory group_factory;
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
};

// Trains this rank's share of `config` (paths as given: make them absolute
// first if needed). InvalidArgument for a config that does not validate at
// env.world_size; the errors of the layers below, annotated with the stage
// (data, model, checkpoint, step N).
absl::StatusOr<TrainResult> Train(const TrainConfig& config,
                                  const TrainerEnv& env);

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_TRAINER_H_
