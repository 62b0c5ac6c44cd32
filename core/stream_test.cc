// Tests for CPU streams and events: ordering, cross-stream waits, host waits,
// timeouts and sticky errors.
#include "core/stream.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

constexpr absl::Duration kLong = absl::Seconds(30);

TEST(StreamTest, RunsTasksInOrder) {
  CpuStream stream("s");
  std::vector<int> order;
  for (int i = 0; i < 100; ++i) {
    stream.Enqueue([&order, i] {
      order.push_back(i);
      return absl::OkStatus();
    });
  }
  ASSERT_TRUE(stream.Synchronize(kLong).ok());
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(StreamTest, EventMarksWorkQueuedBeforeIt) {
  CpuStream stream("s");
  std::atomic<bool> release{false};
  std::atomic<int> done{0};
  stream.Enqueue([&] {
    while (!release.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    done = 1;
    return absl::OkStatus();
  });
  std::shared_ptr<Event> e1 = stream.Record();
  stream.Enqueue([&] {
    done = 2;
    return absl::OkStatus();
  });
  std::shared_ptr<Event> e2 = stream.Record();
  EXPECT_FALSE(e1->IsCompleted());
  EXPECT_EQ(e1->Wait(absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  release = true;
  ASSERT_TRUE(e1->Wait(kLong).ok());
  EXPECT_GE(done.load(), 1);
  ASSERT_TRUE(e2->Wait(kLong).ok());
  EXPECT_EQ(done.load(), 2);
  EXPECT_TRUE(e1->IsCompleted());
}

TEST(StreamTest, CrossStreamWaitOrdersWork) {
  CpuStream producer("producer");
  CpuStream consumer("consumer");
  std::atomic<bool> release{false};
  std::vector<std::string> log;
  std::mutex mu;
  auto append = [&](const char* s) {
    std::lock_guard<std::mutex> lock(mu);
    log.push_back(s);
  };
  producer.Enqueue([&] {
    while (!release.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    append("produce");
    return absl::OkStatus();
  });
  std::shared_ptr<Event> produced = producer.Record();
  consumer.Enqueue([&] {
    append("independent");
    return absl::OkStatus();
  });
  consumer.WaitEvent(produced);
  consumer.Enqueue([&] {
    append("consume");
    return absl::OkStatus();
  });
  std::shared_ptr<Event> consumed = consumer.Record();
  // The consumer runs work queued before the wait, then blocks.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(log.size(), 1u);
    EXPECT_EQ(log[0], "independent");
  }
  EXPECT_FALSE(consumed->IsCompleted());
  release = true;
  ASSERT_TRUE(consumed->Wait(kLong).ok());
  ASSERT_EQ(log.size(), 3u);
  EXPECT_EQ(log[1], "produce");
  EXPECT_EQ(log[2], "consume");
}

TEST(StreamTest, HostEventIsComplete) {
  EXPECT_TRUE(HostEvent()->IsCompleted());
  EXPECT_TRUE(HostEvent()->Wait(absl::ZeroDuration()).ok());
  CpuStream s("s");
  s.WaitEvent(HostEvent());
  EXPECT_TRUE(s.Synchronize(kLong).ok());
}

TEST(StreamTest, ErrorIsStickyAndReachesWaiters) {
  CpuStream stream("s");
  int ran = 0;
  stream.Enqueue([&] {
    ++ran;
    return absl::DataLossError("bad chunk");
  });
  stream.Enqueue([&] {
    ++ran;  // Skipped.
    return absl::OkStatus();
  });
  std::shared_ptr<Event> e = stream.Record();
  absl::Status s = e->Wait(kLong);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(stream.Synchronize(kLong).code(), absl::StatusCode::kDataLoss);
  // A stream waiting on the failed event inherits the error.
  CpuStream other("other");
  other.WaitEvent(e);
  EXPECT_EQ(other.Synchronize(kLong).code(), absl::StatusCode::kDataLoss);
}

TEST(StreamTest, WaitOnEventThatNeverCompletesTimesOut) {
  CpuStream stuck("stuck");
  std::atomic<bool> release{false};
  stuck.Enqueue([&] {
    while (!release.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return absl::OkStatus();
  });
  std::shared_ptr<Event> never = stuck.Record();
  CpuStream waiter("waiter", /*wait_timeout=*/absl::Milliseconds(50));
  waiter.WaitEvent(never);
  absl::Status s = waiter.Synchronize(kLong);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("stream waiter waiting on stuck#0"),
            absl::string_view::npos)
      << s;
  release = true;
}

TEST(StreamTest, SynchronizeTimesOutWhileBusy) {
  CpuStream stream("busy");
  std::atomic<bool> release{false};
  stream.Enqueue([&] {
    while (!release.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return absl::OkStatus();
  });
  absl::Status s = stream.Synchronize(absl::Milliseconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("busy"), absl::string_view::npos);
  release = true;
  EXPECT_TRUE(stream.Synchronize(kLong).ok());
}

TEST(StreamTest, DestructorDrainsQueuedWork) {
  std::atomic<int> count{0};
  {
    CpuStream stream("s");
    for (int i = 0; i < 10; ++i) {
      stream.Enqueue([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ++count;
        return absl::OkStatus();
      });
    }
  }
  EXPECT_EQ(count.load(), 10);
}

}  // namespace
}  // namespace fsdpp
