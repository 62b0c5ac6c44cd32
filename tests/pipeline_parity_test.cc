// Pipeline parallelism end to end ([pp]): GPT-2 debug (tied embedding) and
// Llama debug (tied too), with 8 blocks so that 4 ranks x 2 virtual stages
// have a block each, 20 steps of AdamW with clipping (clipped on most
// steps), f32, 4 micro-batches, thread ranks over real Gloo, against the
// single-rank run with the same micro-batch split whose tied weight adds
// its head and embedding gradients as the pipeline's two copies do
// (TrainingRun::tied_copies). The harness also checks that every tensor two
// ranks hold (the tied embedding's copies) is bitwise the same.
//
// Measured (max over tensors of max|diff| / max|ref|):
//  * PP 2 and PP 4, GPipe, 1F1B and interleaved 1F1B (2 stages per rank):
//    losses and parameters bitwise equal, both models.
//  * PP 2 x FSDP 2 (FSDP inside each stage, one reduce-scatter per step):
//    parameters bitwise equal to the reference that reduces and clips like
//    2 data-parallel ranks (emulated_ranks, emulated_norm); losses <= 7.6e-8
//    (the mean over ranks is taken in another order).
//  * PP 2 x TP 2 with sequence parallelism: SGD <= 1.1e-6 (GPT-2), 3.7e-7
//    (Llama); AdamW at lr 1e-3 (see the test) 1.4e-6 (GPT-2), 7.2e-7
//    (Llama); the noise floor <= 8.6e-7; last gradients <= 3.2e-6.
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "models/gpt2/parallelize.h"
#include "models/llama/parallelize.h"
#include "models/testing/parity_testing.h"

namespace fsdpp {
namespace {

using testing_util::Compare;
using testing_util::ParityReport;
using testing_util::PipelineLayout;
using testing_util::PipelineSetup;
using testing_util::Train;
using testing_util::TrainingResult;
using testing_util::TrainingRun;
using testing_util::TrainReference;

struct Family {
  std::string config;
  testing_util::FsdpPlan fsdp;
  testing_util::TensorParallelPlanFn tp;
};

Family Gpt2() {
  return {"gpt2_debug", models::gpt2::ApplyFsdp,
          [](models::Transformer* m, DeviceMesh* mesh) {
            models::gpt2::TensorParallelOptions o;
            o.sequence_parallel = true;
            return models::gpt2::ApplyTensorParallel(m, mesh, o);
          }};
}

Family Llama() {
  return {"llama_debug", models::llama::ApplyFsdp,
          [](models::Transformer* m, DeviceMesh* mesh) {
            models::llama::TensorParallelOptions o;
            o.sequence_parallel = true;
            return models::llama::ApplyTensorParallel(m, mesh, o);
          }};
}

TrainingRun PipelineRun(const std::string& config) {
  TrainingRun run;
  run.config = config;
  run.n_layers = 8;
  run.steps = 20;
  run.batch = 16;
  run.optimizer = TrainingRun::Optimizer::kAdamW;
  run.lr = 0.01;
  run.max_grad_norm = 0.5;
  run.micro_batches = 4;
  return run;
}

// The single-rank run with the same micro-batch split, its tied embedding's
// gradient added up as the pipeline's two copies add theirs.
TrainingResult Reference(TrainingRun run) {
  run.tied_copies = true;
  return TrainReference(run);
}

void ExpectPipelineParity(const Family& family) {
  const TrainingRun run = PipelineRun(family.config);
  const TrainingResult ref = Reference(run);
  int clipped = 0;
  for (double n : ref.grad_norms) clipped += n > run.max_grad_norm;
  ASSERT_GT(clipped, 0) << "the run must exercise clipping";
  struct Case {
    int pp;
    std::string schedule;
    int virtual_stages;
  };
  for (const Case& c : std::vector<Case>{{2, "gpipe", 1},
                                         {2, "1f1b", 1},
                                         {2, "interleaved", 2},
                                         {4, "gpipe", 1},
                                         {4, "1f1b", 1},
                                         {4, "interleaved", 2}}) {
    SCOPED_TRACE(absl::StrCat(family.config, " pp ", c.pp, " ", c.schedule,
                              " V ", c.virtual_stages));
    PipelineLayout layout;
    layout.schedule = c.schedule;
    layout.virtual_stages = c.virtual_stages;
    layout.microbatches = run.micro_batches;
    const TrainingResult got =
        Train(run, {{"pp", c.pp}, {"dp", 1}}, PipelineSetup(layout));
    ASSERT_EQ(got.losses.size(), static_cast<size_t>(run.steps));
    const ParityReport r = Compare(ref, got);
    std::cout << family.config << " pp " << c.pp << " " << c.schedule << ": "
              << r.ToString() << std::endl;
    EXPECT_LE(r.max_loss_rel, 1e-5) << r.ToString();
    EXPECT_LE(r.max_param_rel, 1e-5) << r.ToString();
  }
}

TEST(PipelineParityTest, Gpt2EverySchedule) { ExpectPipelineParity(Gpt2()); }

TEST(PipelineParityTest, LlamaEverySchedule) { ExpectPipelineParity(Llama()); }

// PP 2 x FSDP 2: FSDP inside each stage over dp, gradient sync once per step
// (the last micro-batch's backward), against the reference that reduces
// like 2 data-parallel ranks.
TEST(PipelineParityTest, PipelineTimesFsdp) {
  for (const Family& family : {Gpt2(), Llama()}) {
    SCOPED_TRACE(family.config);
    TrainingRun run = PipelineRun(family.config);
    TrainingRun ref_run = run;
    ref_run.emulated_ranks = 2;
    ref_run.emulated_norm = true;
    ref_run.sync_every_micro_batch = false;
    const TrainingResult ref = Reference(ref_run);
    PipelineLayout layout;
    layout.microbatches = run.micro_batches;
    layout.fsdp_plan = family.fsdp;
    const TrainingResult got =
        Train(run, {{"pp", 2}, {"dp", 2}}, PipelineSetup(layout));
    ASSERT_EQ(got.losses.size(), static_cast<size_t>(run.steps));
    const ParityReport r = Compare(ref, got);
    std::cout << family.config << " pp 2 x fsdp 2: " << r.ToString()
              << std::endl;
    EXPECT_LE(r.max_loss_rel, 1e-5) << r.ToString();
    EXPECT_LE(r.max_param_rel, 1e-5) << r.ToString();
  }
}

// PP 2 x TP 2 with sequence parallelism: the hidden states between stages
// are sequence-sharded [rows, T / 2, C]. Tensor parallelism adds its
// row-wise layers' partial sums in another order than the single model, so
// gradients differ by rounding; as in the tensor-parallel suite
// (models/testing/plan_checks.h) AdamW runs at lr 1e-3, where the dynamics
// do not amplify that beyond the bound, which the test checks: the
// reference and the single-rank run that adds the tied weight's two
// gradients in the other order (the same computation) agree within a
// quarter of the bound. (At lr 1e-2 they are 1e-3 apart for Llama, in its
// tied embedding.) Every loss, final parameter and last gradient within
// 1e-5.
TEST(PipelineParityTest, PipelineTimesTensorParallel) {
  for (const Family& family : {Gpt2(), Llama()}) {
    for (TrainingRun::Optimizer optimizer :
         {TrainingRun::Optimizer::kSgd, TrainingRun::Optimizer::kAdamW}) {
      const bool adamw = optimizer == TrainingRun::Optimizer::kAdamW;
      SCOPED_TRACE(family.config + (adamw ? " AdamW" : " SGD"));
      TrainingRun run = PipelineRun(family.config);
      run.optimizer = optimizer;
      run.lr = adamw ? 1e-3 : 0.05;
      run.adam_eps = 1e-3;  // as the tensor-parallel suite
      const TrainingResult ref = Reference(run);
      const ParityReport floor = Compare(ref, TrainReference(run));
      std::cout << family.config << (adamw ? " AdamW" : " SGD")
                << " noise floor (tied gradients added in the other order): "
                << floor.ToString() << std::endl;
      ASSERT_LE(floor.max_param_rel, 2.5e-6) << floor.ToString();
      PipelineLayout layout;
      layout.microbatches = run.micro_batches;
      layout.tp_plan = family.tp;
      layout.sequence_parallel = true;
      const TrainingResult got =
          Train(run, {{"pp", 2}, {"dp", 1}, {"tp", 2}}, PipelineSetup(layout));
      ASSERT_EQ(got.losses.size(), static_cast<size_t>(run.steps));
      const ParityReport r = Compare(ref, got);
      std::cout << family.config << (adamw ? " AdamW" : " SGD")
                << " pp 2 x tp 2: " << r.ToString() << std::endl;
      EXPECT_LE(r.max_loss_rel, 1e-5) << r.ToString();
      EXPECT_LE(r.max_param_rel, 1e-5) << r.ToString();
      EXPECT_LE(r.max_grad_rel, 1e-5) << r.ToString();
    }
  }
}

}  // namespace
}  // namespace fsdpp
