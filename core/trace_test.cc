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

}  // namespace
}  // namespace fsdpp
