#include "parallel/pipeline_runner.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/allocator.h"
#include "core/status.h"
#include "core/trace.h"
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace parallel {

namespace {

// Tags: the activation into stage s, and the gradient into stage s (from
// stage s + 1).
int ActivationTag(int stage) { return 2 * stage; }
int GradientTag(int stage) { return 2 * stage + 1; }

std::string ShapeText(const Shape& s, DType dtype) {
  return absl::StrCat(DTypeName(dtype), ShapeToString(s));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PipelineRunner>> PipelineRunner::Create(
    ProcessGroup* group, PipelineSchedule schedule,
    std::vector<PipelineStageModule> stages, nn::LossFunction* loss,
    PipelineRunnerOptions options) {
  if (group == nullptr) {
    return absl::InvalidArgumentError("PipelineRunner: no process group");
  }
  FSDPP_RETURN_IF_ERROR(ValidateSchedule(schedule));
  const std::string where =
      absl::StrCat("PipelineRunner (pipeline rank ", group->rank(), " of ",
                   group->size(), ", ", schedule.name, ")");
  if (schedule.ranks != group->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the schedule is for ", schedule.ranks,
                     " ranks, the group has ", group->size()));
  }
  // Meta: a dry run's simulated group (plan/), whose transfers move nothing.
  if (!group->device().is_cpu() && !group->device().is_meta()) {
    return absl::UnimplementedError(absl::StrCat(
        where, ": the runner's tagged transfers need a CPU (Gloo) group, not ",
        group->device().ToString()));
  }
  if (2 * schedule.stages() > P2POp::kMaxP2PTag) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", schedule.stages(), " stages are too many"));
  }
  std::set<int> want;
  for (int s = group->rank(); s < schedule.stages(); s += schedule.ranks) {
    want.insert(s);
  }
  std::set<int> got;
  for (const PipelineStageModule& st : stages) {
    if (st.module == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": stage ", st.stage, " has no module"));
    }
    if (!want.count(st.stage) || !got.insert(st.stage).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": stage ", st.stage,
          " is not this rank's or is given twice; the schedule gives it "
          "stages ",
          absl::StrJoin(want, ", ")));
    }
    const bool last = st.stage + 1 == schedule.stages();
    if (last && loss == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": stage ", st.stage, " is the last and needs a loss"));
    }
    if ((st.stage > 0 && st.input_shape.empty()) ||
        (!last && st.output_shape.empty())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": stage ", st.stage,
                       " needs the shapes of the activations it receives and "
                       "sends"));
    }
  }
  if (got != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the schedule gives this rank stages ",
                     absl::StrJoin(want, ", "), ", got modules for ",
                     absl::StrJoin(got, ", ")));
  }
  std::sort(stages.begin(), stages.end(),
            [](const PipelineStageModule& a, const PipelineStageModule& b) {
              return a.stage < b.stage;
            });
  return absl::WrapUnique(new PipelineRunner(
      group, std::move(schedule), std::move(stages), loss, std::move(options)));
}

PipelineRunner::PipelineRunner(ProcessGroup* group, PipelineSchedule schedule,
                               std::vector<PipelineStageModule> stages,
                               nn::LossFunction* loss,
                               PipelineRunnerOptions options)
    : group_(group),
      schedule_(std::move(schedule)),
      stages_(std::move(stages)),
      loss_(loss),
      options_(std::move(options)),
      recv_stream_(std::make_unique<CpuStream>(
          absl::StrCat("pp-recv-", group->rank()), options_.timeout)) {
  for (const PipelineAction& a : schedule_.actions[group_->rank()]) {
    if (a.kind == PipelineAction::Kind::kBackward) {
      last_backward_[a.stage] = a.microbatch;
    }
  }
  for (const PipelineStageModule& st : stages_) {
    if (st.stage + 1 < schedule_.stages()) {
      send_streams_[ActivationTag(st.stage + 1)] = std::make_unique<CpuStream>(
          absl::StrCat("pp-send-act-", st.stage + 1), options_.timeout);
    }
    if (st.stage > 0) {
      send_streams_[GradientTag(st.stage - 1)] = std::make_unique<CpuStream>(
          absl::StrCat("pp-send-grad-", st.stage - 1), options_.timeout);
    }
  }
}

PipelineRunner::~PipelineRunner() {
  // Sends still queued hold tensors: let them finish or time out.
  WaitForSends().IgnoreError();
}

absl::StatusOr<PipelineStepStats> PipelineRunner::Step(
    const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets,
    float loss_scale) {
  const int m = schedule_.microbatches;
  const bool first = stages_.front().stage == 0;
  const bool last = stages_.back().stage + 1 == schedule_.stages();
  if ((first && static_cast<int>(inputs.size()) != m) ||
      (last && static_cast<int>(targets.size()) != m)) {
    return absl::InvalidArgumentError(
        absl::StrCat("PipelineRunner::Step: ", inputs.size(), " inputs and ",
                     targets.size(), " targets for ", m, " micro-batches"));
  }
  PipelineStepStats stats;
  held_bytes_ = 0;
  for (const PipelineAction& a : schedule_.actions[group_->rank()]) {
    absl::Status s = Run(a, inputs, targets, loss_scale, &stats);
    if (!s.ok()) {
      Release();
      // Let the sends already issued finish or time out, then report.
      WaitForSends().IgnoreError();
      return Annotate(s, absl::StrCat("pipeline rank ", group_->rank(), " ",
                                      a.ToString(), " (", schedule_.name, ")"));
    }
  }
  FSDPP_RETURN_IF_ERROR(WaitForSends());
  return stats;
}

absl::StatusOr<std::vector<float>> PipelineRunner::Evaluate(
    int microbatches, const std::vector<Tensor>& inputs,
    const std::vector<Tensor>& targets) {
  const bool first = stages_.front().stage == 0;
  const bool last = stages_.back().stage + 1 == schedule_.stages();
  if (microbatches < 1 ||
      (first && static_cast<int>(inputs.size()) != microbatches) ||
      (last && static_cast<int>(targets.size()) != microbatches)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PipelineRunner::Evaluate: ", inputs.size(), " inputs and ",
        targets.size(), " targets for ", microbatches, " micro-batches"));
  }
  std::unique_ptr<nn::LossFunction> loss =
      last ? loss_->Clone() : std::unique_ptr<nn::LossFunction>();
  std::vector<float> losses;
  PipelineStepStats unused;
  for (int mb = 0; mb < microbatches; ++mb) {
    for (const PipelineStageModule& st : stages_) {
      const bool is_last = st.stage + 1 == schedule_.stages();
      Tensor input;
      if (st.stage == 0) {
        input = inputs[mb];
      } else {
        absl::StatusOr<Tensor> received = Receive(
            st.input_shape, st.input_dtype, schedule_.RankOf(st.stage - 1),
            ActivationTag(st.stage), &unused);
        if (!received.ok()) {
          WaitForSends().IgnoreError();
          return Annotate(received.status(),
                          absl::StrCat("pipeline rank ", group_->rank(),
                                       " evaluating micro-batch ", mb));
        }
        input = *std::move(received);
      }
      const absl::Status ready = options_.before_forward
                                     ? options_.before_forward(st.stage, mb)
                                     : absl::OkStatus();
      absl::StatusOr<Tensor> output = ready.ok()
                                          ? st.module->Forward(input)
                                          : absl::StatusOr<Tensor>(ready);
      st.module->ReleaseSavedTensors();
      if (!output.ok()) {
        WaitForSends().IgnoreError();
        return Annotate(
            output.status(),
            absl::StrCat("pipeline rank ", group_->rank(), " evaluating stage ",
                         st.stage, " micro-batch ", mb));
      }
      if (is_last) {
        FSDPP_ASSIGN_OR_RETURN(float l, loss->Forward(*output, targets[mb]));
        losses.push_back(l);
      } else {
        FSDPP_RETURN_IF_ERROR(Send(*output, schedule_.RankOf(st.stage + 1),
                                   ActivationTag(st.stage + 1)));
      }
    }
  }
  FSDPP_RETURN_IF_ERROR(WaitForSends());
  return losses;
}

absl::Status PipelineRunner::Run(const PipelineAction& action,
                                 const std::vector<Tensor>& inputs,
                                 const std::vector<Tensor>& targets,
                                 float loss_scale, PipelineStepStats* stats) {
  const PipelineStageModule* st = nullptr;
  for (const PipelineStageModule& s : stages_) {
    if (s.stage == action.stage) st = &s;
  }
  if (st == nullptr) {
    return absl::InternalError("the schedule names a stage this rank lacks");
  }
  if (action.kind == PipelineAction::Kind::kForward) {
    FSDPP_RETURN_IF_ERROR(
        Forward(*st, action.microbatch, inputs, targets, loss_scale, stats));
  } else {
    FSDPP_RETURN_IF_ERROR(Backward(*st, action.microbatch, stats));
  }
  stats->peak_held_bytes = std::max(stats->peak_held_bytes, held_bytes_);
  stats->peak_in_flight =
      std::max(stats->peak_in_flight, static_cast<int>(stashes_.size()));
  return absl::OkStatus();
}

absl::Status PipelineRunner::Forward(const PipelineStageModule& st, int mb,
                                     const std::vector<Tensor>& inputs,
                                     const std::vector<Tensor>& targets,
                                     float loss_scale,
                                     PipelineStepStats* stats) {
  const bool last = st.stage + 1 == schedule_.stages();
  Tensor input;
  if (st.stage == 0) {
    input = inputs[mb];
  } else {
    FSDPP_ASSIGN_OR_RETURN(input, Receive(st.input_shape, st.input_dtype,
                                          schedule_.RankOf(st.stage - 1),
                                          ActivationTag(st.stage), stats));
  }
  const absl::Time start = absl::Now();
  Tensor output;
  {
    TraceSpan span("pp_forward", "compute");
    if (options_.before_forward) {
      FSDPP_RETURN_IF_ERROR(options_.before_forward(st.stage, mb));
    }
    FSDPP_ASSIGN_OR_RETURN(output, st.module->Forward(input));
  }
  if (last) {
    TraceSpan span("pp_loss", "compute");
    FSDPP_ASSIGN_OR_RETURN(float loss, loss_->Forward(output, targets[mb]));
    FSDPP_ASSIGN_OR_RETURN(Tensor dlogits, loss_->Backward(loss_scale));
    stats->losses.push_back(loss);
    held_bytes_ += static_cast<int64_t>(dlogits.nbytes());
    loss_grads_[mb] = std::move(dlogits);
    output = Tensor();
  }
  Module::SavedTensors saved = st.module->StashSavedTensors();
  held_bytes_ += saved.bytes();
  stashes_[{st.stage, mb}] = std::move(saved);
  stats->compute_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  if (!last) {
    if (output.shape() != st.output_shape ||
        output.dtype() != st.output_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage ", st.stage, " output ", output.ToString(), " is not the ",
          ShapeText(st.output_shape, st.output_dtype),
          " the next stage receives"));
    }
    FSDPP_RETURN_IF_ERROR(Send(output, schedule_.RankOf(st.stage + 1),
                               ActivationTag(st.stage + 1)));
  }
  return absl::OkStatus();
}

absl::Status PipelineRunner::Backward(const PipelineStageModule& st, int mb,
                                      PipelineStepStats* stats) {
  const bool last = st.stage + 1 == schedule_.stages();
  Tensor dy;
  if (last) {
    auto it = loss_grads_.find(mb);
    if (it == loss_grads_.end()) {
      return absl::InternalError("no loss gradient for this micro-batch");
    }
    dy = std::move(it->second);
    loss_grads_.erase(it);
    held_bytes_ -= static_cast<int64_t>(dy.nbytes());
  } else {
    FSDPP_ASSIGN_OR_RETURN(dy, Receive(st.output_shape, st.output_dtype,
                                       schedule_.RankOf(st.stage + 1),
                                       GradientTag(st.stage), stats));
  }
  auto it = stashes_.find({st.stage, mb});
  if (it == stashes_.end()) {
    return absl::InternalError("no stashed forward for this micro-batch");
  }
  held_bytes_ -= it->second.bytes();
  const absl::Time start = absl::Now();
  FSDPP_RETURN_IF_ERROR(st.module->RestoreSavedTensors(std::move(it->second)));
  stashes_.erase(it);
  if (options_.on_last_backward && last_backward_[st.stage] == mb) {
    FSDPP_RETURN_IF_ERROR(options_.on_last_backward(st.stage));
  }
  Tensor dx;
  {
    TraceSpan span("pp_backward", "compute");
    FSDPP_ASSIGN_OR_RETURN(dx, st.module->Backward(dy));
  }
  stats->compute_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  if (st.stage > 0) {
    if (!dx.defined() || dx.shape() != st.input_shape ||
        dx.dtype() != st.input_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage ", st.stage, " input gradient ", dx.ToString(), " is not the ",
          ShapeText(st.input_shape, st.input_dtype),
          " the previous stage sent"));
    }
    FSDPP_RETURN_IF_ERROR(
        Send(dx, schedule_.RankOf(st.stage - 1), GradientTag(st.stage - 1)));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> PipelineRunner::Receive(const Shape& shape, DType dtype,
                                               int peer, int tag,
                                               PipelineStepStats* stats) {
  FSDPP_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(shape, dtype, group_->device(),
                                                 MemoryTag::kActivations));
  const absl::Time start = absl::Now();
  TraceSpan span("pp_recv", "comm_wait");
  CollectiveOptions o;
  o.timeout = options_.timeout;
  o.stream = recv_stream_.get();
  FSDPP_ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      group_->BatchP2P({P2POp::Recv(AsBuffer(t), peer, tag)}, o));
  // The op's own timeout ends it; the diagnosis of the peers comes on top.
  FSDPP_RETURN_IF_ERROR(work->Wait(options_.timeout + absl::Minutes(1)));
  stats->wait_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  return t;
}

absl::Status PipelineRunner::Send(const Tensor& t, int peer, int tag) {
  CollectiveOptions o;
  o.timeout = options_.timeout;
  o.stream = send_streams_.at(tag).get();
  FSDPP_ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      group_->BatchP2P({P2POp::Send(AsBuffer(t), peer, tag)}, o));
  sends_.push_back({t, std::move(work)});
  // Drop the sends already done (their tensors' memory with them).
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(),
                              [](const PendingSend& p) {
                                return p.work->IsCompleted() &&
                                       p.work->Wait(absl::ZeroDuration()).ok();
                              }),
               sends_.end());
  return absl::OkStatus();
}

absl::Status PipelineRunner::WaitForSends() {
  absl::Status first;
  for (PendingSend& p : sends_) {
    absl::Status s = p.work->Wait(options_.timeout + absl::Minutes(1));
    if (!s.ok() && first.ok()) first = s;
  }
  sends_.clear();
  return first;
}

void PipelineRunner::Release() {
  for (const PipelineStageModule& st : stages_) {
    st.module->ReleaseSavedTensors();
  }
  stashes_.clear();
  loss_grads_.clear();
  held_bytes_ = 0;
}

absl::Status SumSharedGradients(ProcessGroup* pipeline,
                                const PipelineSchedule& schedule, Tensor* first,
                                Tensor* last, absl::Duration timeout) {
  if (first == nullptr && last == nullptr) return absl::OkStatus();
  if (first != nullptr && last != nullptr) {
    FSDPP_RETURN_IF_ERROR(Add(*first, *last, first));
    return Copy(*first, last);
  }
  if (pipeline == nullptr) {
    return absl::InvalidArgumentError("SumSharedGradients: no pipeline group");
  }
  Tensor* mine = first != nullptr ? first : last;
  const int peer = first != nullptr ? schedule.RankOf(schedule.stages() - 1)
                                    : schedule.RankOf(0);
  if (peer == pipeline->rank()) {
    return absl::InvalidArgumentError(
        "SumSharedGradients: this rank holds the first and the last stage but "
        "only one copy of the shared weight's gradient was given");
  }
  FSDPP_ASSIGN_OR_RETURN(
      Tensor theirs, Tensor::Empty(mine->shape(), mine->dtype(), mine->device(),
                                   MemoryTag::kGrads));
  CollectiveOptions o;
  o.timeout = timeout;
  FSDPP_ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      pipeline->BatchP2P(
          {P2POp::Send(AsBuffer(*mine), peer, P2POp::kMaxP2PTag),
           P2POp::Recv(AsBuffer(theirs), peer, P2POp::kMaxP2PTag)},
          o));
  FSDPP_RETURN_IF_ERROR(Annotate(work->Wait(timeout + absl::Minutes(1)),
                                 "summing a shared weight's gradient copies"));
  return Add(*mine, theirs, mine);
}

}  // namespace parallel
}  // namespace fsdpp
