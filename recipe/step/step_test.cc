// The step against a plain loop written out here: PlainStep's loss and
// gradients equal, bit for bit, forward/backward per micro-batch with the
// scale folded in; the observer caps the micro-batches and sees the phases;
// FSDP's reductions switch per micro-batch as documented (no_sync
// accumulation, HSDP's one all-reduce); PipelineStep on two thread ranks
// gives the whole model's loss and gradients; bad counts are refused.
#include "recipe/step/step.h"

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/pipeline.h"
#include "models/transformer.h"
#include "optim/clip.h"
#include "tensor/dtensor.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace recipe {
namespace {

using models::Transformer;

constexpr int64_t kRows = 2, kSeq = 8;

// Micro-batch m: deterministic ids and targets below the vocabulary.
MicroBatch Batch(int64_t m, int64_t vocab) {
  std::vector<int64_t> ids, targets;
  for (int64_t i = 0; i < kRows * kSeq; ++i) {
    ids.push_back((i * 7 + m * 13 + 1) % vocab);
    targets.push_back((i * 5 + m * 3 + 2) % vocab);
  }
  return {*Tensor::FromInts({kRows, kSeq}, ids),
          *Tensor::FromInts({kRows, kSeq}, targets)};
}

MicroBatchSource Source(int64_t vocab) {
  return [vocab](int64_t m) -> absl::StatusOr<MicroBatch> {
    return Batch(m, vocab);
  };
}

// A whole gpt2_debug model with its parameters' gradients as one-rank
// DTensors.
struct WholeModel {
  std::unique_ptr<Transformer> model;
  std::vector<std::string> names;
  std::vector<DTensor> grads;
  std::vector<DTensor*> grad_ptrs;
};

WholeModel MakeWhole(DeviceMesh* mesh, int64_t n_layers = 2) {
  WholeModel w;
  models::TransformerConfig config = *models::ConfigByName("gpt2_debug");
  config.n_layers = n_layers;
  w.model = *Transformer::Create(config);
  EXPECT_TRUE(w.model->ToEmpty(Device::Cpu()).ok());
  EXPECT_TRUE(w.model->InitWeights(7).ok());
  for (auto& [name, p] : w.model->NamedParameters()) {
    EXPECT_TRUE(p->EnsureGrad().ok());
    w.names.push_back(name);
    w.grads.push_back(
        *DTensor::FromLocal(p->grad, mesh, {Placement::Replicate()}, p->shape));
  }
  for (DTensor& g : w.grads) w.grad_ptrs.push_back(&g);
  return w;
}

std::vector<float> Values(const Tensor& t) { return *t.ToFloats(); }

// fn on a one-rank mesh.
void OnOneRank(const std::function<void(DeviceMesh*)>& fn) {
  testing_util::RunOnMesh({{"one", 1}},
                          [&](int, DeviceMesh& mesh) { fn(&mesh); });
}

TEST(PlainStepTest, EqualsTheLoopWrittenOut) {
  OnOneRank([&](DeviceMesh* mesh) {
    WholeModel a = MakeWhole(mesh), b = MakeWhole(mesh);
    const int64_t vocab = a.model->config().vocab_size;
    PlainStep step(a.model.get(), a.grad_ptrs);
    absl::StatusOr<StepLoss> got = step.ForwardBackward(3, 4.0, Source(vocab));
    ASSERT_TRUE(got.ok()) << got.status();
    // The loop: each micro-batch's backward scaled by 4 / 3.
    ASSERT_TRUE(ZeroGrad(b.grad_ptrs).ok());
    double loss = 0;
    for (int64_t m = 0; m < 3; ++m) {
      const MicroBatch batch = Batch(m, vocab);
      const float l = *b.model->ForwardLoss(batch.ids, batch.targets);
      ASSERT_TRUE(b.model->Backward(1.0f / 3.0f * 4.0f).ok());
      loss += static_cast<double>(l) / 3;
    }
    EXPECT_EQ(got->loss, loss);
    EXPECT_GT(got->loss, 0);
    for (size_t i = 0; i < a.grads.size(); ++i) {
      EXPECT_EQ(Values(a.grads[i].local()), Values(b.grads[i].local()))
          << a.names[i];
    }
    // The step zeroes first: a second one gives the same gradients.
    ASSERT_TRUE(step.ForwardBackward(3, 4.0, Source(vocab)).ok());
    for (size_t i = 0; i < a.grads.size(); ++i) {
      EXPECT_EQ(Values(a.grads[i].local()), Values(b.grads[i].local()))
          << a.names[i];
    }
  });
}

// Records what a step tells its observer; runs `run` micro-batches.
class Recorder : public StepObserver {
 public:
  explicit Recorder(int64_t run) : run_(run) {}
  int64_t MicroBatchesToRun(int64_t) override { return run_; }
  void MicroBatchBegins(int64_t index, int64_t run) override {
    events.push_back(absl::StrCat("begin ", index, "/", run));
  }
  void MicroBatchEnded(int64_t index, int64_t run) override {
    events.push_back(absl::StrCat("end ", index, "/", run));
  }
  void PhaseEnded(absl::string_view phase) override {
    events.push_back(std::string(phase));
  }
  std::vector<std::string> events;

 private:
  int64_t run_;
};

TEST(PlainStepTest, TheObserverCapsTheMicroBatchesAndSeesThePhases) {
  OnOneRank([&](DeviceMesh* mesh) {
    WholeModel a = MakeWhole(mesh);
    PlainStep step(a.model.get(), a.grad_ptrs);
    Recorder recorder(2);
    int64_t fetched = 0;
    const int64_t vocab = a.model->config().vocab_size;
    absl::StatusOr<StepLoss> got = step.ForwardBackward(
        5, 1.0,
        [&](int64_t m) -> absl::StatusOr<MicroBatch> {
          ++fetched;
          return Batch(m, vocab);
        },
        &recorder);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(fetched, 2);
    EXPECT_EQ(recorder.events,
              (std::vector<std::string>{"begin 0/2", "forward 1", "backward 1",
                                        "end 0/2", "begin 1/2", "forward 2",
                                        "backward 2", "end 1/2"}));
  });
}

TEST(PlainStepTest, RefusesNoMicroBatchesAndPassesSourceErrorsOn) {
  OnOneRank([&](DeviceMesh* mesh) {
    WholeModel a = MakeWhole(mesh);
    PlainStep step(a.model.get(), a.grad_ptrs);
    const int64_t vocab = a.model->config().vocab_size;
    EXPECT_EQ(step.ForwardBackward(0, 1.0, Source(vocab)).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(step.EvaluateSum(0, Source(vocab)).status().code(),
              absl::StatusCode::kInvalidArgument);
    Recorder none(0), too_many(3);
    EXPECT_EQ(
        step.ForwardBackward(2, 1.0, Source(vocab), &none).status().code(),
        absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        step.ForwardBackward(2, 1.0, Source(vocab), &too_many).status().code(),
        absl::StatusCode::kInvalidArgument);
    absl::Status s =
        step.ForwardBackward(2, 1.0,
                             [](int64_t) -> absl::StatusOr<MicroBatch> {
                               return absl::DataLossError("the loader broke");
                             })
            .status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    // A step's micro-batches must agree on its loss targets, and the count
    // is >= 0 (or -1: none).
    const auto counted = [vocab](int64_t first, int64_t later) {
      return [=](int64_t m) -> absl::StatusOr<MicroBatch> {
        MicroBatch b = Batch(m, vocab);
        b.step_loss_tokens = m == 0 ? first : later;
        return b;
      };
    };
    s = step.ForwardBackward(2, 1.0, counted(32, 31)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("micro-batch 1 says the step counts 31 loss "
                               "targets, micro-batch 0 said 32"),
              std::string::npos)
        << s;
    EXPECT_EQ(step.EvaluateSum(2, counted(32, -1)).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(step.ForwardBackward(1, 1.0, counted(-2, -2)).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(step.set_loss_ranks(0).code(),
              absl::StatusCode::kInvalidArgument);
    // Every target counted, as the count would: the same loss.
    absl::StatusOr<StepLoss> plain =
        step.ForwardBackward(2, 1.0, Source(vocab));
    absl::StatusOr<StepLoss> normalised =
        step.ForwardBackward(2, 1.0, counted(32, 32));
    ASSERT_TRUE(plain.ok() && normalised.ok()) << normalised.status();
    EXPECT_NEAR(normalised->loss, plain->loss, 1e-6 * plain->loss);
  });
}

TEST(PlainStepTest, EvaluateSumIsTheForwardLosses) {
  OnOneRank([&](DeviceMesh* mesh) {
    WholeModel a = MakeWhole(mesh);
    PlainStep step(a.model.get(), a.grad_ptrs);
    const int64_t vocab = a.model->config().vocab_size;
    double sum = 0;
    for (int64_t m = 0; m < 3; ++m) {
      const MicroBatch batch = Batch(m, vocab);
      sum += *a.model->EvalLoss(batch.ids, batch.targets);
    }
    absl::StatusOr<double> got = step.EvaluateSum(3, Source(vocab));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, sum);
  });
}

// FSDP on [replicate 2, shard 2]: every micro-batch reduce-scatters unless
// the sync is only on the last; the replicas all-reduce once per step.
TEST(PlainStepTest, SwitchesFsdpReductionsPerMicroBatch) {
  for (bool every : {true, false}) {
    SCOPED_TRACE(every ? "sync every micro-batch" : "sync on the last");
    testing_util::RunOnMesh(
        {{"replicate", 2}, {"shard", 2}}, [&](int, DeviceMesh& mesh) {
          auto model =
              *Transformer::Create(*models::ConfigByName("gpt2_debug"));
          fsdp::FsdpPlanOptions options;
          options.shard.mesh = &mesh;
          std::vector<Module*> blocks(model->blocks().begin(),
                                      model->blocks().end());
          absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
              fsdp::ShardBlocksThenRoot(model.get(), blocks, options);
          ASSERT_TRUE(units.ok()) << units.status();
          ASSERT_TRUE(fsdp::InitShardedWeights(model.get(), 3).ok());
          std::vector<DTensor*> grads;
          for (fsdp::ShardedParameter* sp :
               fsdp::ShardedParameters(model.get())) {
            grads.push_back(&sp->grad);
          }
          PlainStep step(model.get(), grads, {*units, nullptr, every});
          const int64_t vocab = model->config().vocab_size;
          ASSERT_TRUE(step.ForwardBackward(3, 1.0, Source(vocab)).ok());
          for (fsdp::FsdpUnit* u : *units) {
            EXPECT_EQ(u->stats().reduce_scatters, every ? 3 : 1) << u->name();
            EXPECT_EQ(u->stats().replica_all_reduces, 1) << u->name();
          }
        });
  }
}

// Two pipeline ranks of a whole 2-block model (no FSDP), 1F1B over 2
// micro-batches: the loss and every gradient those of the whole model's
// plain step (the tied embedding's copies summed).
TEST(PipelineStepTest, EqualsTheWholeModelsStep) {
  StepLoss ref;
  std::map<std::string, std::vector<float>> ref_grads;
  models::TransformerConfig config;
  OnOneRank([&](DeviceMesh* mesh) {
    WholeModel whole = MakeWhole(mesh);
    config = whole.model->config();
    PlainStep plain(whole.model.get(), whole.grad_ptrs);
    ref = *plain.ForwardBackward(2, 1.0, Source(config.vocab_size));
    for (size_t i = 0; i < whole.grads.size(); ++i) {
      ref_grads[whole.names[i]] = Values(whole.grads[i].local());
    }
  });
  const int64_t vocab = config.vocab_size;
  testing_util::RunOnMesh({{"pp", 2}}, [&](int rank, DeviceMesh& mesh) {
    ProcessGroup* pp = *mesh.Group("pp");
    parallel::PipelineSchedule schedule =
        *parallel::MakePipelineSchedule("1f1b", 2, 1, 2);
    std::vector<models::PipelineStagePart> parts =
        *models::BuildPipelineParts(config, {}, schedule, rank);
    std::vector<PipelineStageTraining> stages;
    std::vector<std::unique_ptr<DTensor>> grads;
    for (models::PipelineStagePart& part : parts) {
      ASSERT_TRUE(part.model->ToEmpty(Device::Cpu()).ok());
      ASSERT_TRUE(part.model->InitWeights(7).ok());
      PipelineStageTraining stage;
      for (auto& [name, p] : part.model->NamedParameters()) {
        ASSERT_TRUE(p->EnsureGrad().ok());
        grads.push_back(std::make_unique<DTensor>(*DTensor::FromLocal(
            p->grad, &mesh, {Placement::Replicate()}, p->shape)));
        stage.grads.push_back({name, grads.back().get()});
      }
      stage.part = std::move(part);
      stages.push_back(std::move(stage));
    }
    absl::StatusOr<std::unique_ptr<PipelineStep>> step =
        PipelineStep::Create(pp, schedule, std::move(stages), {});
    ASSERT_TRUE(step.ok()) << step.status();
    absl::StatusOr<StepLoss> got =
        (*step)->ForwardBackward(2, 1.0, Source(vocab));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_NEAR(got->loss, ref.loss, 1e-6 * ref.loss);
    EXPECT_EQ((*step)->ForwardBackward(3, 1.0, Source(vocab)).status().code(),
              absl::StatusCode::kInvalidArgument);
    int tied_counted = 0;
    const std::vector<models::PipelineStagePart>& held = (*step)->parts();
    size_t g = 0;
    for (const models::PipelineStagePart& part : held) {
      for (auto& [name, p] : part.model->NamedParameters()) {
        const std::vector<float> mine = Values(p->grad);
        const std::vector<float>& want = ref_grads.at(name);
        ASSERT_EQ(mine.size(), want.size()) << name;
        for (size_t i = 0; i < mine.size(); ++i) {
          ASSERT_NEAR(mine[i], want[i], 1e-5f + 1e-4f * std::fabs(want[i]))
              << name << "[" << i << "]";
        }
        tied_counted +=
            name == "wte.weight" && (*step)->norm_options().counts[g];
        ++g;
      }
    }
    // The tied weight counts in the norm on the first stage only.
    EXPECT_EQ(tied_counted, rank == 0 ? 1 : 0);
  });
}

}  // namespace
}  // namespace recipe
}  // namespace fsdpp
