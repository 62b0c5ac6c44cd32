// tools/plan on the shipped configs: the breakdown for models far too large
// for this machine (nothing is allocated), the refusal of the Llama-3.2-1B
// config on a 24 GiB machine at 2 ranks with the settings that would fit,
// and the size parser.
#include "tools/plan/plan_tool.h"

#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace plan_tool {
namespace {

TEST(ParseBytesTest, UnitsAndErrors) {
  EXPECT_EQ(*ParseBytes("80GiB"), int64_t{80} << 30);
  EXPECT_EQ(*ParseBytes("24G"), int64_t{24} << 30);
  EXPECT_EQ(*ParseBytes("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(*ParseBytes("1.5KiB"), 1536);
  EXPECT_EQ(*ParseBytes("80GB"), int64_t{80000000000});
  EXPECT_EQ(*ParseBytes("1000"), 1000);
  EXPECT_EQ(ParseBytes("lots").status().message(),
            "'lots' is not a size (e.g. 80GiB, 24G, 512MiB, or bytes)");
  EXPECT_TRUE(absl::StrContains(ParseBytes("3 parsecs").status().message(),
                                "unknown unit ' parsecs'"));
}

TEST(PlanToolTest, Llama3_8bAnd70bOnH100s) {
  PlanToolOptions o;
  o.config_path = "trainer/configs/llama3_8b.textproto";
  o.world = 64;
  o.ranks_per_node = 8;
  o.device = "h100";
  absl::StatusOr<std::string> out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "Plan: llama3_8b (8.030 B parameters)"))
      << *out;
  EXPECT_TRUE(absl::StrContains(*out, ": fits")) << *out;
  // 70B at 8 GPUs: the sharded fp32 state alone (16 bytes a parameter / 8)
  // is 141 GB.
  o.overrides = {"model.name=llama3_70b", "parallelism.hpz_degree=1"};
  o.world = 8;
  o.search = true;
  out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "Plan: llama3_70b (70.554 B parameters)"))
      << *out;
  EXPECT_TRUE(absl::StrContains(*out, "DOES NOT FIT")) << *out;
  // What does fit: the state offloaded to the host, with checkpointing.
  EXPECT_TRUE(absl::StrContains(
      *out, " 1. W=8, ZeRO-3, bf16/f32, AC, offload, fused attention"))
      << *out;
  // At 64 ranks it fits without offload.
  o.world = 64;
  o.search = false;
  out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, ": fits")) << *out;
}

// The embedded default at pp 2 on 4 ranks: the plan says, as the trainer's
// header does, that the pipeline micro-batches were raised.
TEST(PlanToolTest, SaysWhatTheConfigResolutionChanged) {
  PlanToolOptions o;
  o.world = 4;
  o.overrides = {"parallelism.pp=2"};
  absl::StatusOr<std::string> out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StartsWith(*out,
                               "note: pipeline micro-batches: 2 (micro batch "
                               "4), raised from the 1 accumulation step(s)"))
      << *out;
}

// A GPU plan resolves the config for CUDA, as the trainer there would
// (document masking off by default: the masked attention is not cuDNN's);
// the CPU plan keeps it on.
TEST(PlanToolTest, GpuPlansResolveTheConfigForCuda) {
  PlanToolOptions o;
  o.config_path = "trainer/configs/llama_1b.textproto";
  o.world = 8;
  o.device = "h100";
  absl::StatusOr<std::string> out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(
      *out, "note: data.document_masking off: on CUDA the masked attention"))
      << *out;
  EXPECT_FALSE(absl::StrContains(*out, "document masks")) << *out;
  o.device = "cpu";
  o.calibrate = false;
  out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "fused attention, document masks"))
      << *out;
}

TEST(PlanToolTest, Llama1bAtTwoRanksOnTwentyFourGiBIsRefusedWithFixes) {
  PlanToolOptions o;
  o.config_path = "trainer/configs/llama_1b.textproto";
  o.overrides = {"parallelism.dp_shard=2"};
  o.world = 2;
  o.calibrate = false;
  o.memory_budget = int64_t{12} << 30;  // 24 GiB shared by 2 ranks
  // By default the two ranks' reduce-scatters go through shared memory,
  // which holds no ring buffers and reads the bf16 gradients where they are
  // (held as gradients until it completes, with no comm buffer to copy
  // them into): the config does not fit (12.28 GiB with the 256 MiB
  // outside the allocators), but 2 x 2048 tokens a micro-batch do.
  absl::StatusOr<std::string> out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "DOES NOT FIT")) << *out;
  EXPECT_TRUE(
      absl::StrContains(*out, "comm                0.0 KiB      849.0 MiB"))
      << *out;
  const std::string first =
      " 1. W=2, ZeRO-3, bf16/f32, AC, fused attention, document masks, "
      "batch 2 x 2048 x 64  11.63 GiB ";
  const size_t at = out->find(first);
  ASSERT_NE(at, std::string::npos) << *out;
  const std::string line = out->substr(at, out->find('\n', at) - at);
  EXPECT_TRUE(absl::EndsWith(line, " fits")) << line;
  // Over TCP the ring reduce-scatter's buffers (1.47 GiB more at the peak)
  // make every strategy too large.
  o.overrides.push_back("comm.shared_memory=false");
  out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "DOES NOT FIT")) << *out;
  EXPECT_TRUE(
      absl::StrContains(*out, "comm                0.0 KiB       2.41 GiB"))
      << *out;
  // fp32 masters: 4 bytes per parameter, half the model per rank.
  EXPECT_TRUE(absl::StrContains(
      *out, "params 2.30 GiB (617907200 of 1235814400 elements)"))
      << *out;
  // None fits; the list leads with the least memory: 2 x 2048 tokens a
  // micro-batch, whose LM head runs fused with the loss (the 2048 of 1 x
  // 2048 do not outweigh a chunk of logits plus dW, so it stays unfused).
  EXPECT_TRUE(absl::StrContains(
      *out,
      " 1. W=2, ZeRO-3, bf16/f32, AC, fused attention, document masks, "
      "batch 2 x 2048 x 64  13.10 GiB"))
      << *out;
  // Unfused everywhere, 1 x 2048 needs the least.
  o.overrides.push_back("training.loss_chunk_tokens=0");
  out = RunPlanTool(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out,
                                " 1. W=2, ZeRO-3, bf16/f32, AC, fused "
                                "attention, unfused loss head, document "
                                "masks, batch 1 x 2048 x 128  13.26 GiB"))
      << *out;
}

TEST(PlanToolTest, BadInputSaysWhat) {
  PlanToolOptions o;
  o.world = 0;
  EXPECT_EQ(RunPlanTool(o).status().message(), "--world must be >= 1, got 0");
  o.world = 2;
  o.device = "tpu";
  EXPECT_TRUE(absl::StrContains(RunPlanTool(o).status().message(),
                                "unknown device 'tpu'"));
  o.device = "cpu";
  o.overrides = {"parallelism.pp=3"};
  const absl::Status pp = RunPlanTool(o).status();
  EXPECT_EQ(pp.code(), absl::StatusCode::kInvalidArgument) << pp;
  EXPECT_TRUE(absl::StrContains(pp.message(), "pp")) << pp;
}

}  // namespace
}  // namespace plan_tool
}  // namespace fsdpp
