// Runs a pipeline schedule ([pp]): this rank's stage modules, the
// activations and gradients between stages over point-to-point transfers of
// the pipeline process group, and the loss on the last stage.
//
// A stage is any Module mapping its input (ids for stage 0, the previous
// stage's output otherwise) to its output (the logits for the last stage);
// its Backward maps the gradient of its output to that of its input. The
// runner executes the rank's actions of a PipelineSchedule in order:
//
//   forward (s, i)   input: micro-batch i's (stage 0) or received from the
//                    rank of stage s - 1; Forward; the last stage computes
//                    the loss against micro-batch i's targets and its
//                    gradient right away (keeping dLoss/dlogits, not the
//                    logits); other stages send the output to the rank of
//                    stage s + 1. Then what the module saved for backward is
//                    stashed (Module::StashSavedTensors), so that several
//                    micro-batches can be in flight on one module.
//   backward (s, i)  the output gradient: kept from the loss (last stage) or
//                    received from the rank of stage s + 1; the stash of
//                    (s, i) restored; Backward; the input gradient sent to
//                    the rank of stage s - 1 (not for stage 0).
//
// Parameter gradients accumulate in the modules over the micro-batches (the
// caller scales them, e.g. by 1 / m); `on_last_backward` runs before each
// stage's last backward of the step, so FSDP syncs (reduce-scatters) once per
// step: the caller turns gradient sync off before Step and on there.
//
// Transfers are tagged by (receiving stage, direction) (P2POp::tag), each
// send on a stream of its own tag: a send waits only for its receiver, never
// blocks the rank, and activations and gradients between the same two ranks
// cannot be mistaken for one another. A receive waits at most `timeout`;
// a dead or stuck peer fails the step with the process group's diagnosis
// (which names the ranks whose heartbeat stopped).
#ifndef FSDPP_PARALLEL_PIPELINE_RUNNER_H_
#define FSDPP_PARALLEL_PIPELINE_RUNNER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/process_group.h"
#include "core/dtype.h"
#include "core/stream.h"
#include "nn/loss.h"
#include "nn/module.h"
#include "parallel/pipeline_schedule.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace parallel {

// One stage this rank runs.
struct PipelineStageModule {
  int stage = 0;             // global stage index
  Module* module = nullptr;  // not owned
  // Per micro-batch: the activation a stage > 0 receives, and the one a
  // stage < last sends (its output; checked before sending).
  Shape input_shape;
  DType input_dtype = DType::kF32;
  Shape output_shape;
  DType output_dtype = DType::kF32;
};

struct PipelineRunnerOptions {
  // Bound on each receive and on the final wait for the sends.
  absl::Duration timeout = absl::Minutes(30);
  // Called before the last backward of `stage` in a step (e.g. FSDP's
  // set_requires_gradient_sync(true)); may be empty.
  std::function<absl::Status(int stage)> on_last_backward;
  // Called before each forward of `stage` on micro-batch `microbatch`
  // (training and evaluation), e.g. to give a stage the micro-batch's ids
  // for its document masks or context-parallel positions; what the module
  // keeps from it must be among its saved tensors (stashed with them until
  // the backward). May be empty.
  std::function<absl::Status(int stage, int microbatch)> before_forward;
};

// What one step did on this rank.
struct PipelineStepStats {
  // The last stage's loss per micro-batch (empty on other ranks).
  std::vector<float> losses;
  // The most bytes held at once for backward: the stashed saved tensors of
  // the micro-batches in flight plus the kept loss gradients (the
  // activation memory the schedule costs, beyond one running forward).
  int64_t peak_held_bytes = 0;
  // The most micro-batches in flight at once (forward done, backward not).
  int peak_in_flight = 0;
  // Seconds spent computing (forwards, backwards, the loss) and waiting
  // for received tensors: the measured bubble is wait / (compute + wait).
  double compute_seconds = 0;
  double wait_seconds = 0;
};

class PipelineRunner {
 public:
  // `group`: the pipeline ranks (schedule.ranks of them, this rank's index
  // in it its pipeline rank). `stages`: exactly the stages the schedule
  // gives this rank, each with a module. `loss` (not owned): the loss on
  // the last stage's output; required on the rank holding the last stage.
  // InvalidArgument naming what does not match.
  static absl::StatusOr<std::unique_ptr<PipelineRunner>> Create(
      ProcessGroup* group, PipelineSchedule schedule,
      std::vector<PipelineStageModule> stages, nn::LossFunction* loss,
      PipelineRunnerOptions options = {});
  ~PipelineRunner();
  PipelineRunner(const PipelineRunner&) = delete;
  PipelineRunner& operator=(const PipelineRunner&) = delete;

  // One step: inputs[i] is micro-batch i's input to stage 0 (used on that
  // stage's rank), targets[i] its targets (used on the last stage's rank);
  // the loss gradient is scaled by `loss_scale`. Both lists have the
  // schedule's micro-batch count where used. On error the modules' saved
  // tensors are released (parameter gradients may be partial: skip the
  // optimizer step) and the error names the action.
  absl::StatusOr<PipelineStepStats> Step(const std::vector<Tensor>& inputs,
                                         const std::vector<Tensor>& targets,
                                         float loss_scale = 1.0f);

  // A forward-only pass (evaluation): every micro-batch through this rank's
  // stages in order, nothing kept for backward (the modules' saved tensors
  // are released after each forward); the losses on the last stage's rank
  // (a copy of the loss, so a pending backward's is untouched), empty
  // elsewhere. Any number `microbatches` >= 1, the same on every rank;
  // inputs and targets as for Step.
  absl::StatusOr<std::vector<float>> Evaluate(
      int microbatches, const std::vector<Tensor>& inputs,
      const std::vector<Tensor>& targets);

  const PipelineSchedule& schedule() const { return schedule_; }
  int pipeline_rank() const { return group_->rank(); }

 private:
  PipelineRunner(ProcessGroup* group, PipelineSchedule schedule,
                 std::vector<PipelineStageModule> stages,
                 nn::LossFunction* loss, PipelineRunnerOptions options);
  absl::Status Run(const PipelineAction& action,
                   const std::vector<Tensor>& inputs,
                   const std::vector<Tensor>& targets, float loss_scale,
                   PipelineStepStats* stats);
  absl::Status Forward(const PipelineStageModule& st, int mb,
                       const std::vector<Tensor>& inputs,
                       const std::vector<Tensor>& targets, float loss_scale,
                       PipelineStepStats* stats);
  absl::Status Backward(const PipelineStageModule& st, int mb,
                        PipelineStepStats* stats);
  // Receives a tensor of `shape` / `dtype` from `peer` with `tag`.
  absl::StatusOr<Tensor> Receive(const Shape& shape, DType dtype, int peer,
                                 int tag, PipelineStepStats* stats);
  // Sends `t` to `peer` with `tag` on that tag's stream; keeps t alive
  // until the send completed.
  absl::Status Send(const Tensor& t, int peer, int tag);
  absl::Status WaitForSends();
  void Release();

  ProcessGroup* group_;
  PipelineSchedule schedule_;
  std::vector<PipelineStageModule> stages_;
  nn::LossFunction* loss_;
  PipelineRunnerOptions options_;
  std::unique_ptr<CpuStream> recv_stream_;
  std::map<int, std::unique_ptr<CpuStream>> send_streams_;  // by tag
  struct PendingSend {
    Tensor tensor;
    std::shared_ptr<Work> work;
  };
  std::vector<PendingSend> sends_;
  // Per (stage, micro-batch): the stash, and the last stage's dLoss/dlogits.
  std::map<std::pair<int, int>, Module::SavedTensors> stashes_;
  std::map<int, Tensor> loss_grads_;
  std::map<int, int> last_backward_;  // stage -> its last backward's mb
  int64_t held_bytes_ = 0;
};

// A weight the first and the last stage both use (a tied embedding and
// head) is held twice, once per stage; after a step's backward its two
// gradient copies are added on both ranks (bitwise the same sum: a + b ==
// b + a), so the copies take the same optimizer steps and stay equal.
// `first` is this rank's gradient (local shard) of stage 0's copy, `last` of
// the last stage's, either null when this rank does not hold that stage
// (both null: nothing to do; both set: one rank holds both stages, added
// locally). The two ranks exchange their shards over `pipeline` (tag
// P2POp::kMaxP2PTag, outside the runner's).
absl::Status SumSharedGradients(ProcessGroup* pipeline,
                                const PipelineSchedule& schedule, Tensor* first,
                                Tensor* last,
                                absl::Duration timeout = absl::Minutes(5));

}  // namespace parallel
}  // namespace fsdpp

#endif  // FSDPP_PARALLEL_PIPELINE_RUNNER_H_
