// CPU streams and events; see stream.h.
#include "core/stream.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace fsdpp {

struct CpuStream::State {
  struct Item {
    uint64_t ticket;
    std::function<absl::Status()> task;  // Skipped when the stream failed.
    std::function<void(const absl::Status&)> on_done;  // Always runs.
    absl::Duration max_runtime;  // Infinite: only the worker runs it.
  };
  State(std::string name, absl::Duration wait_timeout)
      : name(std::move(name)), wait_timeout(wait_timeout) {}

  // Queues an item (under mu); returns its ticket.
  uint64_t PushLocked(std::function<absl::Status()> task,
                      std::function<void(const absl::Status&)> on_done,
                      absl::Duration max_runtime) {
    const uint64_t ticket = next_ticket++;
    queue.push_back(
        Item{ticket, std::move(task), std::move(on_done), max_runtime});
    return ticket;
  }

  // Runs `item` (already popped, with busy set) on the calling thread, then
  // clears busy. `error` is the sticky error when it was popped.
  void Execute(Item& item, absl::Status error) {
    if (item.task && error.ok()) {
      absl::Status status = item.task();
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (this->error.ok()) this->error = status;
        error = this->error;
      }
    }
    if (item.on_done) item.on_done(error);
    std::lock_guard<std::mutex> lock(mu);
    busy = false;
  }

  // The worker: runs items in order while no waiter is running one.
  void Run() {
    for (;;) {
      Item item;
      absl::Status error;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [this] { return !busy && (stopping || !queue.empty()); });
        if (queue.empty()) return;  // stopping and drained.
        item = std::move(queue.front());
        queue.pop_front();
        busy = true;
        error = this->error;
      }
      Execute(item, error);
    }
  }

  // A waiter's help: runs the items up to and including `ticket` on the
  // calling thread while the worker is idle and each item's bound fits
  // before `deadline`; stops at the first that does not. Then wakes the
  // worker if anything is left in the queue (items queued without waking it,
  // or that it left while this thread was running one) or if the stream is
  // stopping (the destructor's wake-up found this thread busy).
  void Help(uint64_t ticket, absl::Time deadline) {
    for (;;) {
      Item item;
      absl::Status error;
      {
        std::lock_guard<std::mutex> lock(mu);
        bool take = !busy && !queue.empty() && queue.front().ticket <= ticket;
        if (take) {
          const absl::Duration bound = queue.front().max_runtime;
          take = bound != absl::InfiniteDuration() &&
                 absl::Now() + bound <= deadline;
        }
        if (!take) {
          if (!queue.empty() || stopping) cv.notify_all();
          return;
        }
        item = std::move(queue.front());
        queue.pop_front();
        busy = true;
        error = this->error;
      }
      Execute(item, error);
    }
  }

  const std::string name;
  const absl::Duration wait_timeout;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> queue;
  uint64_t next_ticket = 0;
  bool busy = false;  // An item is running (on the worker or a waiter).
  bool stopping = false;
  absl::Status error;
  uint64_t next_event = 0;
};

namespace {

// Completion state shared by a recorded CPU event and its stream.
class CpuEvent final : public Event {
 public:
  CpuEvent(std::string name, std::weak_ptr<CpuStream::State> stream)
      : name_(std::move(name)), stream_(std::move(stream)) {}

  void set_ticket(uint64_t ticket) { ticket_ = ticket; }

  void Complete(const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      status_ = status;
    }
    cv_.notify_all();
  }

  bool IsCompleted() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

  absl::Status Wait(absl::Duration timeout) const override {
    const absl::Time deadline = absl::Now() + timeout;
    if (!IsCompleted()) {
      if (std::shared_ptr<CpuStream::State> stream = stream_.lock()) {
        stream->Help(ticket_, deadline);
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    const absl::Duration left =
        std::max(absl::ZeroDuration(), deadline - absl::Now());
    if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(left),
                      [this] { return done_; })) {
      return absl::DeadlineExceededError(
          absl::StrCat("event ", name_, " did not complete within ",
                       absl::FormatDuration(timeout)));
    }
    return status_;
  }

  std::string name() const override { return name_; }

 private:
  const std::string name_;
  const std::weak_ptr<CpuStream::State> stream_;
  uint64_t ticket_ = 0;  // Set before the event is handed out.
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
};

class CompletedEvent final : public Event {
 public:
  bool IsCompleted() const override { return true; }
  absl::Status Wait(absl::Duration) const override { return absl::OkStatus(); }
  std::string name() const override { return "host"; }
};

}  // namespace

std::shared_ptr<Event> HostEvent() {
  static const std::shared_ptr<Event> event =
      std::make_shared<CompletedEvent>();
  return event;
}

CpuStream::CpuStream(std::string name, absl::Duration wait_timeout)
    : state_(std::make_shared<State>(std::move(name), wait_timeout)) {
  worker_ = std::thread([state = state_] { state->Run(); });
}

CpuStream::~CpuStream() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
  }
  state_->cv.notify_all();
  worker_.join();
}

const std::string& CpuStream::name() const { return state_->name; }

void CpuStream::Enqueue(std::function<absl::Status()> task,
                        absl::Duration max_runtime) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->PushLocked(std::move(task), nullptr, max_runtime);
  }
  state_->cv.notify_all();
}

std::shared_ptr<Event> CpuStream::Record() {
  return EnqueueAndRecord(nullptr, absl::ZeroDuration());
}

std::shared_ptr<Event> CpuStream::EnqueueAndRecord(
    std::function<absl::Status()> task, absl::Duration max_runtime,
    bool wake_worker) {
  std::shared_ptr<CpuEvent> event;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (task) state_->PushLocked(std::move(task), nullptr, max_runtime);
    event = std::make_shared<CpuEvent>(
        absl::StrCat(state_->name, "#", state_->next_event++), state_);
    // Completing an event takes no time: any waiter may do it.
    event->set_ticket(state_->PushLocked(
        nullptr,
        [event](const absl::Status& status) { event->Complete(status); },
        absl::ZeroDuration()));
  }
  if (wake_worker) state_->cv.notify_all();
  return event;
}

void CpuStream::WaitEvent(std::shared_ptr<Event> event) {
  if (event->IsCompleted()) {
    // Still propagate a failure of the awaited work.
    absl::Status status = event->Wait(absl::ZeroDuration());
    if (status.ok()) return;
  }
  const absl::Duration timeout = state_->wait_timeout;
  const std::string stream_name = state_->name;
  Enqueue(
      [event, timeout, stream_name]() -> absl::Status {
        absl::Status status = event->Wait(timeout);
        if (status.ok()) return status;
        return absl::Status(
            status.code(), absl::StrCat("stream ", stream_name, " waiting on ",
                                        event->name(), ": ", status.message()));
      },
      timeout);
}

absl::Status CpuStream::Synchronize(absl::Duration timeout) {
  std::shared_ptr<Event> event = Record();
  absl::Status status = event->Wait(timeout);
  if (absl::IsDeadlineExceeded(status) && !event->IsCompleted()) {
    return absl::DeadlineExceededError(
        absl::StrCat("stream ", state_->name, " did not drain within ",
                     absl::FormatDuration(timeout)));
  }
  return status;
}

absl::Status CpuStream::status() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->error;
}

}  // namespace fsdpp
