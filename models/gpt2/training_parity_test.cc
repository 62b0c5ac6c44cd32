// 20 training steps of GPT-2 debug through its FSDP plan with gradient-norm
// clipping on W = 1, 2, 3, 4 (thread ranks over real Gloo) against the
// unsharded single-process run, which sees the whole batch.
//
// What is checked, and why the AdamW parameter bound is not 1e-5:
//  * f32, every W: per-step losses within 1e-5 relative (measured ~1.5e-7).
//  * W = 1: losses and parameters bitwise equal after 20 AdamW steps (FSDP
//    itself changes no bit).
//  * W > 1 with SGD: final parameters within 1e-5 relative (per tensor,
//    max|diff| / max|ref|; measured <= 2.5e-6).
//  * W > 1 with AdamW: final parameters within 2e-3 (measured 6.4e-4,
//    6.0e-4, 4.8e-4 for W = 2, 3, 4; plain data parallelism without
//    sharding (fsdp::Replicate) measures the same ~5e-4). Splitting the
//    batch over ranks changes the summation order of every weight gradient,
//    so gradients differ from the reference by ~1e-7 of the magnitude of
//    their summands. Where a gradient cancels to below eps = 1e-8 (GPT-2's
//    key bias, whose exact gradient is 0, gets only rounding noise, ~1e-12
//    to 1e-10), AdamW's update lr * m / (sqrt(v) + eps) ~ lr * g / eps
//    follows that noise, which differs between splits; after 20 steps
//    c_attn.bias differs by up to ~8e-6 absolute, ~6e-4 of its largest
//    entry. This is a property of AdamW on any data-parallel split, not of
//    FSDP (W = 1 is bitwise).
//  * bf16 parameters with f32 reduce-scatter: losses within 2e-2 of the f32
//    reference (measured <= 4e-4).
// The measured numbers are printed and recorded as test properties.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>

#include "gtest/gtest.h"
#include "models/gpt2/parallelize.h"
#include "models/gpt2/parity_testing.h"

namespace fsdpp {
namespace models {
namespace gpt2 {
namespace {

using testing_util::ParityReport;
using testing_util::TrainingResult;
using testing_util::TrainingRun;

constexpr char kConfig[] = "gpt2_debug";
constexpr double kMaxGradNorm = 1.0;
constexpr double kF32Bound = 1e-5;
// See the file comment: AdamW amplifies the data-parallel rounding of
// gradients that cancel to ~eps; measured <= 6.4e-4.
constexpr double kAdamWParamBound = 2e-3;

TrainingRun Run(TrainingRun::Optimizer optimizer) {
  TrainingRun run;
  run.config = kConfig;
  run.steps = 20;
  run.optimizer = optimizer;
  run.lr = optimizer == TrainingRun::Optimizer::kAdamW ? 1e-3 : 0.05;
  run.weight_decay = 0.1;
  run.max_grad_norm = kMaxGradNorm;
  return run;
}

const TrainingResult& Reference(TrainingRun::Optimizer optimizer) {
  static const TrainingResult* adamw = new TrainingResult(
      testing_util::TrainReference(Run(TrainingRun::Optimizer::kAdamW)));
  static const TrainingResult* sgd = new TrainingResult(
      testing_util::TrainReference(Run(TrainingRun::Optimizer::kSgd)));
  return optimizer == TrainingRun::Optimizer::kAdamW ? *adamw : *sgd;
}

TrainingResult TrainSharded(TrainingRun::Optimizer optimizer, int world,
                            DType param_dtype) {
  FsdpPlanOptions options;
  options.shard.mp_policy.param_dtype = param_dtype;
  options.shard.mp_policy.reduce_dtype = DType::kF32;
  return testing_util::Train(Run(optimizer), {{"dp", world}},
                             testing_util::FsdpPlanSetup(ApplyFsdp, options));
}

ParityReport F32Report(TrainingRun::Optimizer optimizer, int world) {
  const TrainingResult& ref = Reference(optimizer);
  EXPECT_EQ(ref.losses.size(), 20u);
  // The runs must exercise clipping.
  EXPECT_GT(*std::max_element(ref.grad_norms.begin(), ref.grad_norms.end()),
            kMaxGradNorm);
  const ParityReport r =
      testing_util::Compare(ref, TrainSharded(optimizer, world, DType::kF32));
  std::cout << kConfig << " f32 "
            << (optimizer == TrainingRun::Optimizer::kAdamW ? "AdamW" : "SGD")
            << " W=" << world << ": " << r.ToString() << std::endl;
  ::testing::Test::RecordProperty("max_loss_rel",
                                  std::to_string(r.max_loss_rel));
  ::testing::Test::RecordProperty("max_param_rel",
                                  std::to_string(r.max_param_rel));
  return r;
}

TEST(Gpt2TrainingParityTest, AdamWOneRankIsBitwise) {
  const ParityReport r = F32Report(TrainingRun::Optimizer::kAdamW, 1);
  EXPECT_EQ(r.max_loss_rel, 0) << r.ToString();
  EXPECT_EQ(r.max_param_rel, 0) << r.ToString();
}

TEST(Gpt2TrainingParityTest, AdamWTwoToFourRanks) {
  for (int world : {2, 3, 4}) {
    const ParityReport r = F32Report(TrainingRun::Optimizer::kAdamW, world);
    EXPECT_LE(r.max_loss_rel, kF32Bound) << "W=" << world << r.ToString();
    EXPECT_LE(r.max_param_rel, kAdamWParamBound)
        << "W=" << world << r.ToString();
  }
}

TEST(Gpt2TrainingParityTest, SgdTwoToFourRanks) {
  for (int world : {2, 3, 4}) {
    const ParityReport r = F32Report(TrainingRun::Optimizer::kSgd, world);
    EXPECT_LE(r.max_loss_rel, kF32Bound) << "W=" << world << r.ToString();
    EXPECT_LE(r.max_param_rel, kF32Bound) << "W=" << world << r.ToString();
  }
}

TEST(Gpt2TrainingParityTest, Bf16ParamsTrackF32Losses) {
  const TrainingResult& ref = Reference(TrainingRun::Optimizer::kAdamW);
  for (int world : {2, 4}) {
    const TrainingResult got =
        TrainSharded(TrainingRun::Optimizer::kAdamW, world, DType::kBF16);
    ASSERT_EQ(got.losses.size(), ref.losses.size());
    double worst = 0;
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      worst = std::max(worst, std::fabs(got.losses[i] - ref.losses[i]));
      EXPECT_NEAR(got.losses[i], ref.losses[i], 2e-2)
          << "W=" << world << " step " << i;
    }
    std::cout << kConfig << " bf16 AdamW W=" << world << ": max |loss diff| "
              << worst << std::endl;
    ::testing::Test::RecordProperty(
        "max_loss_abs_diff_w" + std::to_string(world), std::to_string(worst));
  }
}

}  // namespace
}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp
