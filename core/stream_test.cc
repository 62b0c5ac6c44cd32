// Tests for CPU streams and events: ordering, cross-stream waits, host waits,
// timeouts and sticky errors; waiters running queued work themselves.
#include "core/stream.h"

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
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

// A task with a bound, queued without waking the worker: the waiter runs it
// (and the event after it) on its own thread.
TEST(StreamHelpTest, WaiterRunsABoundedTaskItself) {
  CpuStream stream("s");
  std::thread::id ran_on;
  std::shared_ptr<Event> done = stream.EnqueueAndRecord(
      [&] {
        ran_on = std::this_thread::get_id();
        return absl::OkStatus();
      },
      absl::Seconds(1), /*wake_worker=*/false);
  ASSERT_TRUE(done->Wait(kLong).ok());
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

// Without a bound, or with one that does not fit the wait's deadline, the
// waiter leaves the task to the worker (which it wakes).
TEST(StreamHelpTest, UnboundedOrTooLongTasksStayOnTheWorker) {
  CpuStream stream("s");
  for (absl::Duration bound : {absl::InfiniteDuration(), absl::Minutes(5)}) {
    std::thread::id ran_on;
    std::shared_ptr<Event> done = stream.EnqueueAndRecord(
        [&] {
          ran_on = std::this_thread::get_id();
          return absl::OkStatus();
        },
        bound, /*wake_worker=*/false);
    ASSERT_TRUE(done->Wait(absl::Seconds(60)).ok());
    EXPECT_NE(ran_on, std::this_thread::get_id()) << bound;
  }
}

// A waiter never runs work past the event it waits for, nor while the worker
// is running an item: order is kept.
TEST(StreamHelpTest, WaiterKeepsOrder) {
  CpuStream stream("s");
  std::atomic<bool> release{false};
  std::vector<int> order;
  std::mutex mu;
  auto note = [&](int i) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(i);
  };
  stream.Enqueue(
      [&] {
        while (!release.load())
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        note(0);
        return absl::OkStatus();
      },
      absl::Seconds(5));
  std::shared_ptr<Event> first = stream.EnqueueAndRecord(
      [&] {
        note(1);
        return absl::OkStatus();
      },
      absl::Seconds(1));
  std::shared_ptr<Event> second = stream.EnqueueAndRecord(
      [&] {
        note(2);
        return absl::OkStatus();
      },
      absl::Seconds(1), /*wake_worker=*/false);
  // The worker is inside item 0: the waiter can neither take item 1 nor get
  // past it, and its wait times out on time.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const absl::Time start = absl::Now();
  EXPECT_EQ(first->Wait(absl::Milliseconds(50)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  release = true;
  ASSERT_TRUE(second->Wait(kLong).ok());
  EXPECT_TRUE(first->IsCompleted());
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
}

// A failure in a task a waiter ran is sticky like any other.
TEST(StreamHelpTest, ErrorOfAHelpedTaskIsSticky) {
  CpuStream stream("s");
  std::shared_ptr<Event> failed = stream.EnqueueAndRecord(
      [] { return absl::InternalError("boom"); }, absl::Seconds(1),
      /*wake_worker=*/false);
  EXPECT_EQ(failed->Wait(kLong).message(), "boom");
  bool ran = false;
  std::shared_ptr<Event> later = stream.EnqueueAndRecord(
      [&] {
        ran = true;
        return absl::OkStatus();
      },
      absl::Seconds(1), /*wake_worker=*/false);
  EXPECT_EQ(later->Wait(kLong).message(), "boom");
  EXPECT_FALSE(ran);
  EXPECT_EQ(stream.status().message(), "boom");
}

// Items queued without waking the worker still run if nobody waits: the
// destructor drains them.
TEST(StreamHelpTest, DestructorRunsUnwokenItems) {
  std::atomic<int> count{0};
  {
    CpuStream stream("s");
    for (int i = 0; i < 3; ++i) {
      stream.EnqueueAndRecord(
          [&] {
            ++count;
            return absl::OkStatus();
          },
          absl::Seconds(1), /*wake_worker=*/false);
    }
  }
  EXPECT_EQ(count.load(), 3);
}

// Destroying the stream while a waiter runs one of its items: the worker,
// told to stop while the item was busy, must be woken when the waiter is
// done, or the destructor would never return.
TEST(StreamHelpTest, DestructorWhileAWaiterRunsAnItem) {
  auto stream = std::make_unique<CpuStream>("s");
  // Have the worker run once (an unbounded task only it may run) and go idle,
  // so that it does not find the next item on its own when it starts.
  stream->Enqueue([] { return absl::OkStatus(); });
  ASSERT_TRUE(stream->Synchronize(kLong).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::atomic<bool> started{false};
  std::atomic<bool> release{false};
  std::thread::id ran_on;
  std::shared_ptr<Event> done = stream->EnqueueAndRecord(
      [&] {
        ran_on = std::this_thread::get_id();
        started = true;
        while (!release.load())
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return absl::OkStatus();
      },
      absl::Seconds(10), /*wake_worker=*/false);
  std::thread::id waiter_id;
  std::thread waiter([&] {
    waiter_id = std::this_thread::get_id();
    EXPECT_TRUE(done->Wait(kLong).ok());
  });
  while (!started.load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto destroyed = std::make_shared<std::promise<void>>();
  std::future<void> destroyed_future = destroyed->get_future();
  std::thread destroyer([s = stream.release(), destroyed] {
    delete s;
    destroyed->set_value();
  });
  // Let the destructor mark the stream stopping while the item is busy.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  release = true;
  waiter.join();
  EXPECT_EQ(ran_on, waiter_id) << "the premise: the waiter ran the item";
  const bool returned = destroyed_future.wait_for(std::chrono::seconds(30)) ==
                        std::future_status::ready;
  EXPECT_TRUE(returned) << "~CpuStream did not return";
  if (returned) {
    destroyer.join();
  } else {
    destroyer.detach();  // Hung: leave it, the failure is reported.
  }
}

}  // namespace
}  // namespace fsdpp
