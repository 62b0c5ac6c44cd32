// Test helper: a dry run (plan/dry_run.h) against the same step run for real
// (RunStepOn), phase by phase, per memory tag. Used by the host test
// (dry_run_test, Gloo) and the GPU one (dry_run_cuda_test, NCCL).
#ifndef FSDPP_PLAN_DRY_RUN_TESTING_H_
#define FSDPP_PLAN_DRY_RUN_TESTING_H_

#include <string>
#include <vector>

#include "core/allocator.h"
#include "gtest/gtest.h"
#include "plan/dry_run.h"

namespace fsdpp {
namespace plan {
namespace testing_util {

// A model of the zoo and a layout to dry-run and run.
struct Case {
  const char* model;
  recipe::Layout layout;
};

// GPT-2 and Llama debug at one rank, 2 x 32 tokens: f32; bf16 compute; bf16
// with activation checkpointing and 2 micro-batches; bf16 with the LM head
// fused with the loss in chunks of 24 tokens and 2 micro-batches; ZeRO-2 with
// the unfused attention; and, with `host` (the CPU backend), FSDP's
// offloaded state and bf16 with document masks and selective activation
// checkpointing.
inline std::vector<Case> SmallCases(bool host) {
  std::vector<Case> cases;
  for (const char* model : {"gpt2_debug", "llama_debug"}) {
    recipe::Layout s;
    s.micro_batch = 2;
    s.seq_len = 32;
    cases.push_back({model, s});
    recipe::Layout bf16 = s;
    bf16.param_dtype = DType::kBF16;
    cases.push_back({model, bf16});
    recipe::Layout ac = bf16;
    ac.activation_checkpointing = nn::CheckpointPolicy::Full();
    ac.grad_accumulation = 2;
    cases.push_back({model, ac});
    recipe::Layout fused_head = bf16;
    fused_head.loss_chunk_tokens = 24;
    fused_head.grad_accumulation = 2;
    cases.push_back({model, fused_head});
    recipe::Layout unfused = s;
    unfused.fused_attention = false;
    unfused.reshard_after_forward = false;
    cases.push_back({model, unfused});
    if (host) {
      recipe::Layout off = s;
      off.offload = true;
      cases.push_back({model, off});
      recipe::Layout docs = bf16;
      docs.document_eot_id = 3;
      docs.activation_checkpointing = nn::CheckpointPolicy::Selective();
      cases.push_back({model, docs});
    }
  }
  return cases;
}

inline void ExpectSameStats(const MemoryStats& dry, const MemoryStats& real,
                            const std::string& where) {
  for (int t = 0; t < kNumMemoryTags; ++t) {
    const char* tag = MemoryTagName(static_cast<MemoryTag>(t));
    EXPECT_EQ(dry.current[t], real.current[t]) << where << " current " << tag;
    EXPECT_EQ(dry.peak[t], real.peak[t]) << where << " peak " << tag;
  }
  EXPECT_EQ(dry.total_peak, real.total_peak) << where << " total peak";
}

// Every phase's live and peak bytes, the step's peak and its phase, and the
// sharded state's bytes equal.
inline void ExpectSameRun(const DryRunResult& dry, const DryRunResult& real) {
  ASSERT_EQ(dry.phases.size(), real.phases.size());
  for (size_t p = 0; p < dry.phases.size(); ++p) {
    EXPECT_EQ(dry.phases[p].name, real.phases[p].name);
    ExpectSameStats(dry.phases[p].stats, real.phases[p].stats,
                    dry.phases[p].name);
  }
  EXPECT_EQ(dry.peak_bytes, real.peak_bytes);
  EXPECT_EQ(dry.peak_phase, real.peak_phase);
  EXPECT_EQ(dry.param_bytes, real.param_bytes);
  EXPECT_EQ(dry.optimizer_bytes, real.optimizer_bytes);
  EXPECT_GT(dry.peak_bytes, dry.after_setup.total_current);
}

}  // namespace testing_util
}  // namespace plan
}  // namespace fsdpp

#endif  // FSDPP_PLAN_DRY_RUN_TESTING_H_
