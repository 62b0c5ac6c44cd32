// CPU streams and events; see stream.h.
#include "core/stream.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdpp {
namespace {

// Completion state shared by a recorded CPU event and its stream.
class CpuEvent final : public Event {
 public:
  explicit CpuEvent(std::string name) : name_(std::move(name)) {}

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
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
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
    : name_(std::move(name)), wait_timeout_(wait_timeout) {
  worker_ = std::thread([this] { Run(); });
}

CpuStream::~CpuStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void CpuStream::Push(Item item) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(item));
  }
  cv_.notify_all();
}

void CpuStream::Enqueue(std::function<absl::Status()> task) {
  Push(Item{std::move(task), nullptr});
}

std::shared_ptr<Event> CpuStream::Record() {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = next_event_++;
  }
  auto event = std::make_shared<CpuEvent>(absl::StrCat(name_, "#", seq));
  Push(Item{nullptr,
            [event](const absl::Status& status) { event->Complete(status); }});
  return event;
}

void CpuStream::WaitEvent(std::shared_ptr<Event> event) {
  if (event->IsCompleted()) {
    // Still propagate a failure of the awaited work.
    absl::Status status = event->Wait(absl::ZeroDuration());
    if (status.ok()) return;
  }
  const absl::Duration timeout = wait_timeout_;
  const std::string stream_name = name_;
  Enqueue([event, timeout, stream_name]() -> absl::Status {
    absl::Status status = event->Wait(timeout);
    if (status.ok()) return status;
    return absl::Status(status.code(),
                        absl::StrCat("stream ", stream_name, " waiting on ",
                                     event->name(), ": ", status.message()));
  });
}

absl::Status CpuStream::Synchronize(absl::Duration timeout) {
  std::shared_ptr<Event> event = Record();
  absl::Status status = event->Wait(timeout);
  if (absl::IsDeadlineExceeded(status) && !event->IsCompleted()) {
    return absl::DeadlineExceededError(
        absl::StrCat("stream ", name_, " did not drain within ",
                     absl::FormatDuration(timeout)));
  }
  return status;
}

absl::Status CpuStream::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void CpuStream::Run() {
  for (;;) {
    Item item;
    absl::Status error;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping_ and drained.
      item = std::move(queue_.front());
      queue_.pop_front();
      error = error_;
    }
    if (item.task && error.ok()) {
      absl::Status status = item.task();
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (error_.ok()) error_ = status;
        error = error_;
      }
    }
    if (item.on_done) item.on_done(error);
  }
}

}  // namespace fsdpp
