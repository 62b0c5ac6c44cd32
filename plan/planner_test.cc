#include "plan/planner.h"

#include <cstdio>

#include "gtest/gtest.h"

namespace fsdpp {
namespace plan {
namespace {

TEST(PlannerTest, Smoke) {
  DeviceSpec d = *DeviceByName("h100", 8, false);
  recipe::Layout s;
  s.world = 8;
  s.param_dtype = DType::kBF16;
  s.activation_checkpointing = nn::CheckpointPolicy::Full();
  s.micro_batch = 1;
  s.seq_len = 8192;
  absl::StatusOr<Plan> p = MakePlan(*models::ConfigByName("llama3_8b"), s, d);
  ASSERT_TRUE(p.ok()) << p.status();
  std::printf("%s\n", FormatPlan(*p).c_str());
}

// Context parallelism: a rank computes 1 / cp of its sequence, holds about
// 1 / cp of its activations, and the ring's transfers are in the step
// time: per layer cp - 1 forward shifts of k and v, cp - 1 backward ones
// and cp shifts of their gradients (no activation checkpointing, one
// micro-batch), each charged to the compute's path.
TEST(PlannerTest, ContextParallelSplitsTheWorkAndCountsTheRing) {
  const models::TransformerConfig model = *models::ConfigByName("llama_1b");
  const DeviceSpec d = *DeviceByName("h100", 4, false);
  recipe::Layout s;
  s.world = 4;
  s.param_dtype = DType::kBF16;
  s.micro_batch = 1;
  s.seq_len = 16384;
  absl::StatusOr<Plan> one = MakePlan(model, s, d);
  ASSERT_TRUE(one.ok()) << one.status();
  s.cp = 4;
  absl::StatusOr<Plan> four = MakePlan(model, s, d);
  ASSERT_TRUE(four.ok()) << four.status();
  int p2p = 0;
  for (const SimulatedOp& op : four->run.ops) p2p += op.kind == "p2p";
  EXPECT_EQ(p2p, model.n_layers * (3 * s.cp - 2));
  for (const SimulatedOp& op : one->run.ops) EXPECT_NE(op.kind, "p2p");
  EXPECT_LT(four->time.compute_s, 0.3 * one->time.compute_s);
  EXPECT_GT(four->time.exposed_comm_s, one->time.exposed_comm_s);
  EXPECT_LT(four->run.peak_bytes, one->run.peak_bytes / 2);
}

}  // namespace
}  // namespace plan
}  // namespace fsdpp
