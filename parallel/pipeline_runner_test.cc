// PipelineRunner on thread ranks over real Gloo: every schedule's losses and
// gradients equal the same stages run one micro-batch after another on one
// rank, bitwise; 1F1B holds at most (ranks - rank) micro-batches' activations
// where GPipe holds all of them; a rank that dies mid-step makes the others
// fail naming it, within the timeout; bad stage lists and shapes are refused.
#include "parallel/pipeline_runner.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/gloo_backend.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "mesh/run_on_mesh.h"
#include "nn/block.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/loss.h"
#include "nn/mlp.h"
#include "parallel/pipeline_schedule.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace parallel {
namespace {

using testing_util::RandomTensor;
using testing_util::RunOnMesh;
using testing_util::Values;

constexpr int64_t kC = 6, kV = 11, kT = 4, kRows = 2;

// Stage s of `stages`: a pre-norm block, the last one a block and a head
// [C] -> [V], so the loss sits on the last stage.
class Stage : public Module {
 public:
  explicit Stage(bool head) : Module("Stage") {
    block_ = AddModule("block",
                       std::make_unique<nn::Block>(
                           std::make_unique<nn::LayerNorm>(kC, 1e-5f, true),
                           std::make_unique<nn::Linear>(kC, kC, true, 0.3f),
                           std::make_unique<nn::LayerNorm>(kC, 1e-5f, true),
                           std::make_unique<nn::Mlp>(kC, 2 * kC, 0.3f, 0.3f)));
    if (head) {
      head_ =
          AddModule("head", std::make_unique<nn::Linear>(kC, kV, false, 0.3f));
    }
  }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override {
    absl::StatusOr<Tensor> h = block_->Forward(x);
    if (!h.ok() || head_ == nullptr) return h;
    return head_->Forward(*h);
  }
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override {
    Tensor d = dy;
    if (head_ != nullptr) {
      absl::StatusOr<Tensor> dh = head_->Backward(d);
      if (!dh.ok()) return dh.status();
      d = *dh;
    }
    return block_->Backward(d);
  }

 private:
  Module* block_ = nullptr;
  Module* head_ = nullptr;
};

std::unique_ptr<Stage> MakeStage(int stage, int stages) {
  auto s = std::make_unique<Stage>(stage + 1 == stages);
  EXPECT_TRUE(s->ToEmpty(Device::Cpu()).ok());
  EXPECT_TRUE(s->InitWeights(100 + stage).ok());
  return s;
}

Tensor Input(int mb) { return RandomTensor({kRows, kT, kC}, DType::kF32, mb); }

Tensor Targets(int mb) {
  std::vector<int64_t> v(kRows * kT);
  for (size_t i = 0; i < v.size(); ++i) v[i] = (7 * mb + 3 * i) % kV;
  return *Tensor::FromInts({kRows, kT}, v, DType::kI64);
}

// What a run produced: losses per micro-batch, gradients per stage.
struct Outcome {
  std::vector<float> losses;
  std::map<int, std::vector<std::vector<double>>> grads;
};

// The stages run micro-batch after micro-batch on one rank.
Outcome Reference(int stages, int m) {
  std::vector<std::unique_ptr<Stage>> mods;
  for (int s = 0; s < stages; ++s) mods.push_back(MakeStage(s, stages));
  nn::CrossEntropyLoss loss;
  Outcome out;
  for (int i = 0; i < m; ++i) {
    Tensor h = Input(i);
    for (auto& mod : mods) h = *mod->Forward(h);
    out.losses.push_back(*loss.Forward(h, Targets(i)));
    Tensor d = *loss.Backward(0.5f);
    for (int s = stages - 1; s >= 0; --s) d = *mods[s]->Backward(d);
  }
  for (int s = 0; s < stages; ++s) {
    for (auto& [name, p] : mods[s]->NamedParameters()) {
      out.grads[s].push_back(Values(p->grad));
    }
  }
  return out;
}

std::vector<PipelineStageModule> StageSpecs(
    const PipelineSchedule& schedule, int rank,
    std::vector<std::unique_ptr<Stage>>* owned) {
  std::vector<PipelineStageModule> specs;
  for (int s = rank; s < schedule.stages(); s += schedule.ranks) {
    owned->push_back(MakeStage(s, schedule.stages()));
    PipelineStageModule spec;
    spec.stage = s;
    spec.module = owned->back().get();
    spec.input_shape = {kRows, kT, kC};
    if (s + 1 < schedule.stages()) spec.output_shape = {kRows, kT, kC};
    specs.push_back(spec);
  }
  return specs;
}

// Runs `schedule` on its ranks; the stats per rank and the outcome.
Outcome RunPipeline(const PipelineSchedule& schedule,
                    std::vector<PipelineStepStats>* stats = nullptr) {
  Outcome out;
  std::mutex mu;
  if (stats != nullptr) stats->assign(schedule.ranks, {});
  RunOnMesh({{"pp", schedule.ranks}}, [&](int rank, DeviceMesh& mesh) {
    std::vector<std::unique_ptr<Stage>> owned;
    std::vector<PipelineStageModule> specs = StageSpecs(schedule, rank, &owned);
    nn::CrossEntropyLoss loss;
    std::vector<int> synced;
    PipelineRunnerOptions options;
    options.timeout = absl::Seconds(20);
    options.on_last_backward = [&](int stage) {
      synced.push_back(stage);
      return absl::OkStatus();
    };
    absl::StatusOr<std::unique_ptr<PipelineRunner>> runner =
        PipelineRunner::Create(*mesh.Group("pp"), schedule, specs, &loss,
                               options);
    ASSERT_TRUE(runner.ok()) << runner.status();
    std::vector<Tensor> inputs, targets;
    for (int i = 0; i < schedule.microbatches; ++i) {
      inputs.push_back(Input(i));
      targets.push_back(Targets(i));
    }
    absl::StatusOr<PipelineStepStats> step =
        (*runner)->Step(inputs, targets, 0.5f);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(synced.size(), specs.size());  // once per stage
    std::lock_guard<std::mutex> lock(mu);
    if (stats != nullptr) (*stats)[rank] = *step;
    if (!step->losses.empty()) out.losses = step->losses;
    for (size_t k = 0; k < specs.size(); ++k) {
      for (auto& [name, p] : owned[k]->NamedParameters()) {
        out.grads[specs[k].stage].push_back(Values(p->grad));
      }
    }
  });
  return out;
}

TEST(PipelineRunnerTest, EverySchedulesGradientsEqualTheSequentialRun) {
  std::vector<absl::StatusOr<PipelineSchedule>> schedules = {
      GPipeSchedule(2, 3), OneFOneBSchedule(2, 4), OneFOneBSchedule(4, 5),
      GPipeSchedule(4, 4), Interleaved1F1BSchedule(2, 2, 4)};
  for (const auto& schedule : schedules) {
    ASSERT_TRUE(schedule.ok()) << schedule.status();
    SCOPED_TRACE(schedule->ToString());
    const Outcome got = RunPipeline(*schedule);
    const Outcome want = Reference(schedule->stages(), schedule->microbatches);
    EXPECT_EQ(got.losses, want.losses);
    ASSERT_EQ(got.grads.size(), want.grads.size());
    for (const auto& [stage, grads] : want.grads) {
      EXPECT_EQ(got.grads.at(stage), grads) << "stage " << stage;
    }
  }
}

// Evaluate: forward only, any micro-batch count; the losses equal the
// sequential forwards', nothing stays saved, and a Step afterwards still
// matches (the tags' transfer counts stay in step on both sides).
TEST(PipelineRunnerTest, EvaluateIsTheForwardOnly) {
  const PipelineSchedule schedule = *Interleaved1F1BSchedule(2, 2, 2);
  const Outcome want = Reference(schedule.stages(), 3);
  RunOnMesh({{"pp", 2}}, [&](int rank, DeviceMesh& mesh) {
    std::vector<std::unique_ptr<Stage>> owned;
    std::vector<PipelineStageModule> specs = StageSpecs(schedule, rank, &owned);
    nn::CrossEntropyLoss loss;
    auto runner =
        PipelineRunner::Create(*mesh.Group("pp"), schedule, specs, &loss);
    ASSERT_TRUE(runner.ok()) << runner.status();
    std::vector<Tensor> inputs, targets;
    for (int i = 0; i < 3; ++i) {
      inputs.push_back(Input(i));
      targets.push_back(Targets(i));
    }
    absl::StatusOr<std::vector<float>> losses =
        (*runner)->Evaluate(3, inputs, targets);
    ASSERT_TRUE(losses.ok()) << losses.status();
    if (rank == 1) {
      EXPECT_EQ(*losses, want.losses);
    } else {
      EXPECT_TRUE(losses->empty());
    }
    for (auto& st : owned) EXPECT_TRUE(st->StashSavedTensors().empty());
    EXPECT_EQ((*runner)->Evaluate(0, inputs, targets).status().code(),
              absl::StatusCode::kInvalidArgument);
    inputs.pop_back();
    targets.pop_back();
    absl::StatusOr<PipelineStepStats> step = (*runner)->Step(inputs, targets);
    ASSERT_TRUE(step.ok()) << step.status();
    if (rank == 1) {
      EXPECT_EQ(step->losses,
                std::vector<float>(want.losses.begin(), want.losses.end() - 1));
    }
  });
}

// Activation memory: 1F1B holds at most ranks - rank micro-batches (their
// stashed tensors) whatever the micro-batch count; GPipe holds all m.
TEST(PipelineRunnerTest, OneFOneBActivationsAreBoundedByStagesNotMicroBatches) {
  const int p = 2, m = 8;
  std::vector<PipelineStepStats> gpipe, one_f_one_b;
  RunPipeline(*GPipeSchedule(p, m), &gpipe);
  RunPipeline(*OneFOneBSchedule(p, m), &one_f_one_b);
  for (int r = 0; r < p; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_EQ(gpipe[r].peak_in_flight, m);
    EXPECT_EQ(one_f_one_b[r].peak_in_flight, p - r);
    // Equal micro-batches stash equal bytes: peaks in proportion.
    const int64_t per = gpipe[r].peak_held_bytes / m;
    EXPECT_GT(per, 0);
    EXPECT_EQ(gpipe[r].peak_held_bytes, per * m);
    EXPECT_EQ(one_f_one_b[r].peak_held_bytes, per * (p - r));
  }
}

// Rank 2 of 3 dies at its third forward (its process group crashes, as a
// killed process's would): ranks 0 and 1 fail within the timeout, and the
// error names rank 2 as the one whose heartbeat stopped.
TEST(PipelineRunnerTest, ADeadRankFailsEveryRankNamingIt) {
  const PipelineSchedule schedule = *OneFOneBSchedule(3, 6);
  std::vector<absl::Status> results(3);
  RunOnMesh(
      {{"pp", 3}},
      [&](int rank, DeviceMesh& mesh) {
        ProcessGroup* group = *mesh.Group("pp");
        std::vector<std::unique_ptr<Stage>> owned;
        std::vector<PipelineStageModule> specs =
            StageSpecs(schedule, rank, &owned);
        int forwards = 0;
        if (rank == 2) {
          owned[0]->AddPreForwardHook([&](Module&) -> absl::Status {
            if (++forwards == 3) {
              dynamic_cast<GlooProcessGroup*>(group)->SimulateCrash();
              return absl::AbortedError("rank 2 killed");
            }
            return absl::OkStatus();
          });
        }
        nn::CrossEntropyLoss loss;
        PipelineRunnerOptions options;
        options.timeout = absl::Seconds(2);
        auto runner =
            PipelineRunner::Create(group, schedule, specs, &loss, options);
        ASSERT_TRUE(runner.ok()) << runner.status();
        std::vector<Tensor> inputs, targets;
        for (int i = 0; i < 6; ++i) {
          inputs.push_back(Input(i));
          targets.push_back(Targets(i));
        }
        const absl::Time start = absl::Now();
        results[rank] = (*runner)->Step(inputs, targets).status();
        EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << rank;
      },
      absl::Seconds(60));
  EXPECT_EQ(results[2].code(), absl::StatusCode::kAborted) << results[2];
  for (int r : {0, 1}) {
    EXPECT_FALSE(results[r].ok()) << r;
    EXPECT_NE(results[r].message().find("2 (heartbeat stopped"),
              std::string::npos)
        << "rank " << r << ": " << results[r];
    EXPECT_NE(results[r].message().find(absl::StrCat("pipeline rank ", r)),
              std::string::npos)
        << results[r];
  }
}

TEST(PipelineRunnerTest, BadStagesAndShapesAreRefused) {
  const PipelineSchedule schedule = *OneFOneBSchedule(2, 2);
  RunOnMesh({{"pp", 2}}, [&](int rank, DeviceMesh& mesh) {
    ProcessGroup* group = *mesh.Group("pp");
    std::vector<std::unique_ptr<Stage>> owned;
    std::vector<PipelineStageModule> specs = StageSpecs(schedule, rank, &owned);
    nn::CrossEntropyLoss loss;
    // Another rank's stage.
    std::vector<PipelineStageModule> wrong = specs;
    wrong[0].stage = 1 - rank;
    absl::Status s =
        PipelineRunner::Create(group, schedule, wrong, &loss).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("is not this rank's"), std::string::npos) << s;
    // The last stage without a loss.
    if (rank == 1) {
      s = PipelineRunner::Create(group, schedule, specs, nullptr).status();
      EXPECT_NE(s.message().find("needs a loss"), std::string::npos) << s;
    }
    // A schedule for another pipeline size.
    s = PipelineRunner::Create(group, *OneFOneBSchedule(3, 3), specs, &loss)
            .status();
    EXPECT_NE(s.message().find("the schedule is for 3 ranks"),
              std::string::npos)
        << s;
    // Stage 0 declares an output the next stage does not receive: refused
    // before sending, naming both shapes; rank 1 then times out.
    if (rank == 0) specs[0].output_shape = {kRows, kT, kC + 1};
    PipelineRunnerOptions options;
    options.timeout = absl::Seconds(1);
    auto runner =
        PipelineRunner::Create(group, schedule, specs, &loss, options);
    ASSERT_TRUE(runner.ok()) << runner.status();
    s = (*runner)
            ->Step({Input(0), Input(1)}, {Targets(0), Targets(1)})
            .status();
    EXPECT_FALSE(s.ok());
    if (rank == 0) {
      EXPECT_NE(s.message().find("f32[2, 4, 7] the next stage receives"),
                std::string::npos)
          << s;
      EXPECT_NE(s.message().find("F0.0"), std::string::npos) << s;
    }
  });
}

}  // namespace
}  // namespace parallel
}  // namespace fsdpp
