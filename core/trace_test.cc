#include "core/trace.h"

#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

TEST(TraceTest, SpansRecordOnlyWithACurrentRecorderAndWhileRecording) {
  { TraceSpan span("ignored", "compute"); }  // No recorder: nothing happens.
  TraceRecorder trace(3, "rank 3");
  ScopedCurrentTrace scope(&trace);
  EXPECT_EQ(CurrentTrace(), &trace);
  {
    TraceSpan span("not stored", "compute");
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(trace.num_events(), 0u);
  // Totals are kept while not recording.
  EXPECT_GE(trace.TotalMicros("compute"), 2000);
  trace.SetRecording(true);
  {
    TraceSpan span("forward", "compute");
    span.set_detail("micro-batch 0 \"quoted\"\n");
  }
  trace.SetRecording(false);
  ASSERT_EQ(trace.num_events(), 1u);
  EXPECT_EQ(trace.events()[0].name, "forward");
  EXPECT_EQ(trace.events()[0].track, "main");
  EXPECT_EQ(trace.TotalMicros("comm"), 0);
}

TEST(TraceTest, CurrentRecorderIsPerThreadAndRestored) {
  TraceRecorder a(0, "a"), b(1, "b");
  {
    ScopedCurrentTrace sa(&a);
    {
      ScopedCurrentTrace sb(&b);
      EXPECT_EQ(CurrentTrace(), &b);
    }
    EXPECT_EQ(CurrentTrace(), &a);
    TraceRecorder* seen = &a;
    std::thread([&] { seen = CurrentTrace(); }).join();
    EXPECT_EQ(seen, nullptr);
  }
  EXPECT_EQ(CurrentTrace(), nullptr);
}

TEST(TraceTest, ChromeJsonHasMetadataTracksAndEscapes) {
  TraceRecorder trace(1, "rank 1");
  trace.SetRecording(true);
  trace.Record({"all_gather", "comm", "fsdp:all_gather", 100, 50, "a\"b"});
  trace.Record({"forward", "compute", "main", 90, 70, ""});
  const std::string json = ChromeTraceJson({trace.EventsJson(), ""});
  EXPECT_EQ(json.rfind("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", 0), 0u);
  EXPECT_NE(json.find("\"name\":\"process_name\",\"pid\":1,\"args\":{\"name\":"
                      "\"rank 1\"}"),
            std::string::npos);
  // "main" is track 1, the stream track 2.
  EXPECT_NE(json.find("\"tid\":2,\"args\":{\"name\":\"fsdp:all_gather\"}"),
            std::string::npos);
  EXPECT_NE(json.find("\"name\":\"all_gather\",\"cat\":\"comm\",\"pid\":1,"
                      "\"tid\":2,\"ts\":100,\"dur\":50,\"args\":{\"detail\":"
                      "\"a\\\"b\"}}"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("\"name\":\"forward\",\"cat\":\"compute\",\"pid\":1,"
                      "\"tid\":1,\"ts\":90,\"dur\":70}"),
            std::string::npos)
      << json;
  EXPECT_EQ(json.substr(json.size() - 4), "\n]}\n");
  trace.ClearEvents();
  EXPECT_EQ(trace.num_events(), 0u);
  EXPECT_EQ(trace.TotalMicros("comm"), 50);
}

TEST(OpProfileTest, SelfTimesExcludeNestedSpansAndAddUpToTheOuterSpan) {
  OpProfile profile;
  { OpSpan ignored("before"); }  // No profile: nothing is counted.
  ScopedOpProfile scope(&profile);
  {
    TraceSpan step("step", "step", /*recorder=*/nullptr);
    absl::SleepFor(absl::Milliseconds(4));
    for (int i = 0; i < 3; ++i) {
      OpSpan matmul("Matmul", "matmul");
      absl::SleepFor(absl::Milliseconds(3));
      OpSpan copy("Copy");  // Nested in the matmul: its own row.
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  const std::vector<OpProfile::Row> rows = profile.Rows();
  ASSERT_EQ(rows.size(), 3u);
  // Largest self time first. Which row that is depends on how long each sleep
  // really took (on a loaded machine the step's 4 ms can outlast the matmuls'
  // 9), so the order is checked as a property, the rows by name.
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_GE(rows[i - 1].self_ns, rows[i].self_ns) << "row " << i;
  }
  int64_t self = 0;
  const OpProfile::Row* step = nullptr;
  const OpProfile::Row* matmul = nullptr;
  const OpProfile::Row* copy = nullptr;
  for (const OpProfile::Row& r : rows) {
    self += r.self_ns;
    if (r.name == "step") step = &r;
    if (r.name == "Matmul") matmul = &r;
    if (r.name == "Copy") copy = &r;
  }
  ASSERT_NE(matmul, nullptr);
  EXPECT_EQ(matmul->category, "matmul");
  EXPECT_EQ(matmul->calls, 3);
  EXPECT_GE(matmul->self_ns, 9'000'000);
  // The nested copies count in the matmul's total, not in its self time.
  ASSERT_NE(copy, nullptr);
  EXPECT_EQ(copy->calls, 3);
  EXPECT_GE(copy->self_ns, 3'000'000);
  EXPECT_EQ(matmul->total_ns, matmul->self_ns + copy->total_ns);
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->calls, 1);
  EXPECT_GE(step->self_ns, 4'000'000);
  EXPECT_LT(step->self_ns, step->total_ns - 12'000'000 + 1);
  // The self times partition the outer span's time.
  EXPECT_EQ(self, step->total_ns);
  profile.Clear();
  EXPECT_TRUE(profile.Rows().empty());
}

TEST(OpProfileTest, OpSpansBecomeTraceEventsOnlyWhileRecording) {
  TraceRecorder trace(0, "rank 0");
  ScopedCurrentTrace scope(&trace);
  { OpSpan op("LayerNorm"); }
  EXPECT_EQ(trace.num_events(), 0u);
  EXPECT_EQ(trace.TotalMicros("op"), 0);
  trace.SetRecording(true);
  { OpSpan op("LayerNorm"); }
  ASSERT_EQ(trace.num_events(), 1u);
  EXPECT_EQ(trace.events()[0].name, "LayerNorm");
  EXPECT_EQ(trace.events()[0].category, "op");
}

TEST(OpProfileTest, TableGivesPerStepTimesSharesAndCategories) {
  std::vector<OpProfile::Row> rows = {
      {"Matmul", "matmul", 40, 600'000'000, 600'000'000},
      {"LayerNorm", "op", 20, 100'000'000, 100'000'000},
      {"step", "step", 2, 200'000'000, 1'000'000'000},
  };
  const std::string table = FormatOpTable(rows, 1'000'000'000, 2, 2);
  EXPECT_NE(table.find("Matmul"), std::string::npos) << table;
  // 20 calls per step, 300 ms per step, 60% of the step.
  EXPECT_NE(table.find("20.0      300.000      300.000   60.0%"),
            std::string::npos)
      << table;
  EXPECT_EQ(table.find("step       "), std::string::npos) << table;
  EXPECT_NE(table.find("(1 more ops)"), std::string::npos) << table;
  EXPECT_NE(table.find("step 500.000 ms (mean of 2); by category: matmul "
                       "60.0% step 20.0% op 10.0%; in no span 10.0%"),
            std::string::npos)
      << table;
}

}  // namespace
}  // namespace fsdpp
