// The Transformer's pipeline stages: which parts a rank holds under each
// schedule (blocks, embeddings, head, names), the tied weight's copy, and
// the errors for bad schedules and splits. Training through them is in
// tests/pipeline_parity_test.
#include "models/pipeline.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "models/config.h"
#include "models/transformer.h"
#include "parallel/pipeline_schedule.h"

namespace fsdpp {
namespace models {
namespace {

TransformerConfig Gpt2(int64_t layers) {
  TransformerConfig c = *ConfigByName("gpt2_debug");
  c.n_layers = layers;
  return c;
}

// Interleaved on 2 ranks x 2 stages, 6 blocks cut at 1, 3, 5: rank 0 holds
// stages 0 (embeddings, block 0) and 2 (blocks 3, 4); rank 1 stages 1
// (blocks 1, 2) and 3 (block 5, the head and the tied weight's copy).
TEST(PipelineTest, PartsFollowTheScheduleAndTheCuts) {
  const parallel::PipelineSchedule schedule =
      *parallel::MakePipelineSchedule("interleaved", 2, 2, 4);
  std::vector<PipelineStagePart> r0 =
      *BuildPipelineParts(Gpt2(6), {}, schedule, 0, {1, 3, 5});
  std::vector<PipelineStagePart> r1 =
      *BuildPipelineParts(Gpt2(6), {}, schedule, 1, {1, 3, 5});
  ASSERT_EQ(r0.size(), 2u);
  ASSERT_EQ(r1.size(), 2u);
  EXPECT_EQ(r0[0].stage, 0);
  EXPECT_EQ(r0[1].stage, 2);
  EXPECT_EQ(r1[0].stage, 1);
  EXPECT_EQ(r1[1].stage, 3);
  EXPECT_TRUE(r0[0].model->has_embedding());
  EXPECT_FALSE(r0[0].model->has_head());
  EXPECT_EQ(r0[1].model->first_block(), 3);
  EXPECT_EQ(r0[1].model->blocks().size(), 2u);
  EXPECT_EQ(r1[0].model->first_block(), 1);
  EXPECT_TRUE(r1[1].model->has_head());
  EXPECT_EQ(r1[1].model->NamedParameters().front().first, "wte.weight");
  EXPECT_EQ(TiedCopyName(*r1[1].model), "wte.weight");
  EXPECT_EQ(TiedCopyName(*r0[0].model), "");
  EXPECT_FALSE(CountsInNorm(*r1[1].model, "wte.weight"));
  EXPECT_TRUE(CountsInNorm(*r0[0].model, "wte.weight"));
  EXPECT_TRUE(CountsInNorm(*r1[1].model, "ln_f.weight"));

  PipelineStageModules m = StageModules(r1, {2, 8, 64}, DType::kF32);
  ASSERT_EQ(m.stages.size(), 2u);
  EXPECT_EQ(m.stages[0].input_shape, (Shape{2, 8, 64}));
  EXPECT_EQ(m.stages[0].output_shape, (Shape{2, 8, 64}));
  EXPECT_TRUE(m.stages[1].output_shape.empty());  // the last stage
  EXPECT_EQ(m.loss, r1[1].model->mutable_loss());
  EXPECT_EQ(StageModules(r0, {2, 8, 64}, DType::kF32).loss, nullptr);
}

TEST(PipelineTest, BadSplitsNameTheModel) {
  const parallel::PipelineSchedule schedule =
      *parallel::MakePipelineSchedule("1f1b", 4, 1, 4);
  absl::Status s = BuildPipelineParts(Gpt2(2), {}, schedule, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("pipeline stages of gpt2_debug"),
            std::string::npos)
      << s;
  s = BuildPipelineParts(Gpt2(8), {}, schedule, 0, {2, 1, 5}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(BuildPipelineParts(Gpt2(8), {}, schedule, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
