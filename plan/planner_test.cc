#include "plan/planner.h"

#include <cstdio>
#include <string>

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

// Expert parallelism: each rank holds 1 / ep of every MoE layer's experts
// (the sharded state drops by the experts' share), and the token all-to-alls
// (two forward, two backward per MoE layer) are on the step's path.
TEST(PlannerTest, ExpertParallelShardsTheExpertsAndExposesTheAllToAlls) {
  const models::TransformerConfig model = *models::ConfigByName("olmoe_1b_7b");
  const DeviceSpec d = *DeviceByName("h100", 8, false);
  recipe::Layout s;
  s.world = 8;
  s.param_dtype = DType::kBF16;
  s.micro_batch = 1;
  s.seq_len = 4096;
  s.activation_checkpointing = nn::CheckpointPolicy::Full();
  absl::StatusOr<Plan> one = MakePlan(model, s, d);
  ASSERT_TRUE(one.ok()) << one.status();
  s.ep = 8;
  absl::StatusOr<Plan> eight = MakePlan(model, s, d);
  ASSERT_TRUE(eight.ok()) << eight.status();
  int all_to_all = 0;
  double all_to_all_s = 0.0, gathered = 0.0, gathered_one = 0.0;
  for (const SimulatedOp& op : eight->run.ops) {
    if (op.kind == "all_to_all_v") {
      ++all_to_all;
      all_to_all_s += op.in_bytes * (op.group_size - 1.0) / op.group_size /
                      d.link_bytes_per_s;
    }
    if (op.kind == "all_gather") gathered += op.out_bytes;
  }
  for (const SimulatedOp& op : one->run.ops) {
    if (op.kind == "all_gather") gathered_one += op.out_bytes;
  }
  // Four per layer, and two more per layer for full checkpointing's
  // recomputed forward.
  EXPECT_EQ(all_to_all, model.n_layers * 6);
  for (const SimulatedOp& op : one->run.ops) EXPECT_NE(op.kind, "all_to_all_v");
  // Both shard every parameter over the 8 ranks, so the sharded state is
  // the same; with ep 8 a rank gathers none of its experts (efsdp is 1),
  // and the all-to-alls are exposed whole.
  EXPECT_EQ(eight->run.after_setup.current_of(MemoryTag::kParams),
            one->run.after_setup.current_of(MemoryTag::kParams));
  EXPECT_LT(gathered, 0.2 * gathered_one);
  EXPECT_GT(all_to_all_s, 0.0);
  EXPECT_GE(eight->time.exposed_comm_s, all_to_all_s);
  EXPECT_EQ(eight->time.compute_s, one->time.compute_s);

  // ep 8 x tp 2 on 16 ranks: tp splits every expert's hidden too, so a rank
  // holds half the state; every tp rank routes the same tokens, so the
  // all-to-alls are as many and as large as at ep 8. (Without OLMoE's q / k
  // norms, which tensor parallelism does not split: half of ep 8's state
  // less their share.)
  models::TransformerConfig no_qk_norm = model;
  no_qk_norm.qk_norm = false;
  s.world = 16;
  s.tp = 2;
  EXPECT_NE(std::string(MakePlan(model, s, d).status().message())
                .find("q / k norms (qk_norm)"),
            std::string::npos);
  absl::StatusOr<Plan> with_tp = MakePlan(no_qk_norm, s, d);
  ASSERT_TRUE(with_tp.ok()) << with_tp.status();
  int all_to_all_tp = 0;
  double all_to_all_tp_s = 0.0;
  for (const SimulatedOp& op : with_tp->run.ops) {
    if (op.kind != "all_to_all_v") continue;
    ++all_to_all_tp;
    all_to_all_tp_s += op.in_bytes * (op.group_size - 1.0) / op.group_size /
                       d.link_bytes_per_s;
  }
  EXPECT_EQ(all_to_all_tp, all_to_all);
  EXPECT_DOUBLE_EQ(all_to_all_tp_s, all_to_all_s);
  EXPECT_NEAR(with_tp->run.after_setup.current_of(MemoryTag::kParams),
              eight->run.after_setup.current_of(MemoryTag::kParams) / 2.0,
              0.01 * eight->run.after_setup.current_of(MemoryTag::kParams));
}

}  // namespace
}  // namespace plan
}  // namespace fsdpp
