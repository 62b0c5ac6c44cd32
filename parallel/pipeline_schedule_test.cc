// Pipeline schedules: the action lists for 2 and 4 ranks against the
// textbook ones (GPipe; 1F1B as in PipeDream-Flush / Megatron; Megatron's
// interleaved 1F1B), every schedule valid for a range of sizes, the bubble
// of GPipe and 1F1B equal to (P - 1) / (m + P - 1) with equal forward and
// backward times and smaller when interleaved, 1F1B's in-flight micro-batches
// bounded by the ranks (GPipe's by the micro-batches), and bad sizes and
// lists rejected with the reason.
#include "parallel/pipeline_schedule.h"

#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace parallel {
namespace {

TEST(PipelineScheduleTest, TextbookListsForTwoAndFourRanks) {
  EXPECT_EQ(GPipeSchedule(2, 3)->ToString(),
            "rank 0: F0.0 F0.1 F0.2 B0.0 B0.1 B0.2\n"
            "rank 1: F1.0 F1.1 F1.2 B1.0 B1.1 B1.2\n");
  EXPECT_EQ(OneFOneBSchedule(2, 4)->ToString(),
            "rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3\n"
            "rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3\n");
  EXPECT_EQ(OneFOneBSchedule(4, 4)->ToString(),
            "rank 0: F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3\n"
            "rank 1: F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 B1.2 B1.3\n"
            "rank 2: F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 B2.3\n"
            "rank 3: F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3\n");
  // Megatron's interleaving, 2 ranks x 2 chunks (stages 0, 2 on rank 0 and
  // 1, 3 on rank 1), 4 micro-batches in groups of 2: warm-up
  // (P - 1 - r) 2 + (V - 1) P = 4 and 2 forwards.
  EXPECT_EQ(Interleaved1F1BSchedule(2, 2, 4)->ToString(),
            "rank 0: F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 "
            "B0.1 B2.2 B2.3 B0.2 B0.3\n"
            "rank 1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 "
            "B3.2 F3.3 B3.3 B1.2 B1.3\n");
}

TEST(PipelineScheduleTest, EverySizeIsValidAndRuns) {
  for (int p : {1, 2, 3, 4}) {
    for (int m : {1, 2, 4, 8}) {
      SCOPED_TRACE(testing::Message() << "P " << p << " m " << m);
      absl::StatusOr<PipelineSchedule> g = GPipeSchedule(p, m);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_TRUE(ValidateSchedule(*g).ok());
      EXPECT_TRUE(Simulate(*g, 1, 2).ok());
      if (m >= p) {
        absl::StatusOr<PipelineSchedule> o = OneFOneBSchedule(p, m);
        ASSERT_TRUE(o.ok()) << o.status();
        EXPECT_TRUE(ValidateSchedule(*o).ok());
        EXPECT_TRUE(Simulate(*o, 1, 2).ok());
      }
      for (int v : {1, 2, 3}) {
        if (m % p != 0) continue;
        absl::StatusOr<PipelineSchedule> i = Interleaved1F1BSchedule(p, v, m);
        ASSERT_TRUE(i.ok()) << i.status();
        EXPECT_TRUE(ValidateSchedule(*i).ok()) << "V " << v;
        absl::StatusOr<PipelineSimulation> sim = Simulate(*i, 1, 2);
        EXPECT_TRUE(sim.ok()) << "V " << v << ": " << sim.status();
      }
    }
  }
}

TEST(PipelineScheduleTest, BubbleAndInFlightMicroBatches) {
  for (int p : {2, 4}) {
    for (int m : {4, 8, 16}) {
      SCOPED_TRACE(testing::Message() << "P " << p << " m " << m);
      const double textbook = (p - 1.0) / (m + p - 1.0);
      const PipelineSchedule g = *GPipeSchedule(p, m);
      const PipelineSchedule o = *OneFOneBSchedule(p, m);
      EXPECT_NEAR(Simulate(g, 1, 1)->bubble, textbook, 1e-12);
      EXPECT_NEAR(Simulate(o, 1, 1)->bubble, textbook, 1e-12);
      // Backward twice the forward: still the same fraction for both.
      EXPECT_NEAR(Simulate(g, 1, 2)->bubble, textbook, 1e-12);
      EXPECT_NEAR(Simulate(o, 1, 2)->bubble, textbook, 1e-12);
      const PipelineSchedule i = *Interleaved1F1BSchedule(p, 2, m);
      EXPECT_LT(Simulate(i, 1, 2)->bubble, textbook);
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(g.PeakInFlight(r), m);
        EXPECT_EQ(o.PeakInFlight(r), p - r);
      }
    }
  }
}

TEST(PipelineScheduleTest, BadSizesAndListsAreRejected) {
  EXPECT_TRUE(absl::StrContains(OneFOneBSchedule(4, 3).status().message(),
                                "3 micro-batches for 4 pipeline ranks"));
  EXPECT_TRUE(
      absl::StrContains(Interleaved1F1BSchedule(2, 2, 3).status().message(),
                        "must be a multiple of the 2 pipeline ranks"));
  EXPECT_FALSE(GPipeSchedule(0, 4).ok());
  PipelineSchedule s = *GPipeSchedule(2, 2);
  std::swap(s.actions[0][0], s.actions[0][2]);  // B0.0 before F0.0
  EXPECT_TRUE(absl::StrContains(ValidateSchedule(s).message(),
                                "runs B0.0 before its forward"));
  s = *GPipeSchedule(2, 2);
  s.actions[1].pop_back();
  EXPECT_TRUE(absl::StrContains(ValidateSchedule(s).message(),
                                "7 actions, expected 8"));
  // Rank 1 runs its backwards before its forwards can have been fed: the
  // last stage's first backward waits on a forward rank 1 runs later.
  s = *GPipeSchedule(2, 2);
  s.actions[1] = {s.actions[1][1], s.actions[1][0], s.actions[1][2],
                  s.actions[1][3]};  // F1.1 F1.0 B1.0 B1.1: still valid
  EXPECT_TRUE(Simulate(s, 1, 1).ok());
  s.actions[0] = {s.actions[0][0], s.actions[0][2], s.actions[0][1],
                  s.actions[0][3]};  // F0.0 B0.0 F0.1 B0.1
  absl::StatusOr<PipelineSimulation> sim = Simulate(s, 1, 1);
  EXPECT_EQ(sim.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(sim.status().message(), "deadlocks"))
      << sim.status();
}

std::string Describe(const std::vector<StageBlocks>& stages) {
  std::string out;
  for (const StageBlocks& s : stages) {
    out += "[" + std::string(s.embedding ? "E " : "") +
           std::to_string(s.first) + "+" + std::to_string(s.count) +
           std::string(s.head ? " H" : "") + "]";
  }
  return out;
}

TEST(PipelineScheduleTest, StagesSplitTheBlocks) {
  EXPECT_EQ(Describe(*SplitStages(12, 4)), "[E 0+3][3+3][6+3][9+3 H]");
  EXPECT_EQ(Describe(*SplitStages(10, 4)), "[E 0+3][3+3][6+2][8+2 H]");
  EXPECT_EQ(Describe(*SplitStages(5, 1)), "[E 0+5 H]");
  EXPECT_EQ(Describe(*SplitStages(12, 3, {2, 10})), "[E 0+2][2+8][10+2 H]");
  EXPECT_TRUE(absl::StrContains(SplitStages(3, 4).status().message(),
                                "3 blocks cannot fill 4 stages"));
  EXPECT_TRUE(absl::StrContains(SplitStages(12, 3, {4}).status().message(),
                                "1 cut points for 3 stages; give 2"));
  EXPECT_TRUE(absl::StrContains(SplitStages(12, 3, {6, 6}).status().message(),
                                "cut point 1 (block 6) must be after 6"));
  EXPECT_TRUE(absl::StrContains(SplitStages(12, 3, {4, 12}).status().message(),
                                "before 12"));
  EXPECT_FALSE(SplitStages(4, 0).ok());
}

TEST(PipelineScheduleTest, MakePipelineScheduleNamesAndTheirErrors) {
  EXPECT_EQ(MakePipelineSchedule("gpipe", 2, 1, 3)->name, "GPipe");
  EXPECT_EQ(MakePipelineSchedule("1f1b", 2, 1, 3)->name, "1F1B");
  EXPECT_EQ(MakePipelineSchedule("interleaved", 2, 2, 4)->virtual_stages, 2);
  absl::Status s = MakePipelineSchedule("zero-bubble", 2, 1, 4).status();
  EXPECT_NE(s.message().find("not one of gpipe, 1f1b, interleaved"),
            std::string::npos)
      << s;
  s = MakePipelineSchedule("1f1b", 2, 2, 4).status();
  EXPECT_NE(s.message().find("use 'interleaved'"), std::string::npos) << s;
  s = MakePipelineSchedule("interleaved", 2, 1, 4).status();
  EXPECT_NE(s.message().find("pp_virtual_stages >= 2"), std::string::npos) << s;
  // 1F1B needs a micro-batch per rank.
  EXPECT_EQ(MakePipelineSchedule("1f1b", 4, 1, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace parallel
}  // namespace fsdpp
