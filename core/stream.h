// Streams and events: ordered queues of device work and the points that mark
// their progress.
//
// A Stream runs the work queued on it in order. An Event recorded on a stream
// completes when everything queued before it has run; another stream can wait
// on it (ordering its later work after that point) and the host can wait on it
// with a timeout. This is how communication overlaps compute: the comm stream
// waits on an event of the compute stream, and the compute stream (or host)
// later waits on the comm work's event.
//
// On CPU a stream is a worker thread (CpuStream). On CUDA it wraps
// cudaStream_t (core/cuda_stream.h, built under --config=cuda). The host
// thread itself is the CPU "compute stream": host work is complete when
// issued, so HostEvent() is an already-completed event.
//
// Errors are sticky, like CUDA's: when a task fails or a wait times out, the
// stream records the error, skips its remaining work and completes every later
// event with that error, so whoever waits learns what went wrong instead of
// hanging. Every wait has a timeout.
#ifndef FSDPP_CORE_STREAM_H_
#define FSDPP_CORE_STREAM_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/device.h"

namespace fsdpp {

// Default bound for every stream-side wait (a peer stream that never records).
inline constexpr absl::Duration kDefaultStreamWaitTimeout = absl::Minutes(10);

// A point in a stream's work. Thread-safe; shared by its waiters.
class Event {
 public:
  virtual ~Event() = default;
  // True once the marked work finished (successfully or not).
  virtual bool IsCompleted() const = 0;
  // Blocks the calling host thread until completion. Returns the error of the
  // marked work, or DeadlineExceeded naming the event after `timeout`.
  virtual absl::Status Wait(absl::Duration timeout) const = 0;
  // A name for messages ("<stream>#<sequence>").
  virtual std::string name() const = 0;
};

// An event that is complete from the start (work done inline on the host).
std::shared_ptr<Event> HostEvent();

// An ordered work queue on a device.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device device() const = 0;
  virtual const std::string& name() const = 0;
  // Records an event that completes when all work queued so far has run.
  virtual std::shared_ptr<Event> Record() = 0;
  // Work queued after this call starts only after `event` completed. If the
  // event fails or does not complete within the stream's wait timeout, the
  // stream enters the error state.
  virtual void WaitEvent(std::shared_ptr<Event> event) = 0;
  // Blocks the host until all queued work has run; returns the sticky error,
  // or DeadlineExceeded after `timeout`.
  virtual absl::Status Synchronize(absl::Duration timeout) = 0;
  // The sticky error (OK while healthy).
  virtual absl::Status status() const = 0;
};

// A CPU stream: one worker thread running queued tasks in order.
class CpuStream final : public Stream {
 public:
  // `wait_timeout` bounds each WaitEvent on the worker.
  explicit CpuStream(std::string name,
                     absl::Duration wait_timeout = kDefaultStreamWaitTimeout);
  // Runs the work already queued, then stops the worker.
  ~CpuStream() override;
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  // Queues `task`. It runs on the worker after all earlier work unless the
  // stream is in the error state, in which case it is skipped. A non-OK
  // return puts the stream in the error state.
  void Enqueue(std::function<absl::Status()> task);

  Device device() const override { return Device::Cpu(); }
  const std::string& name() const override { return name_; }
  std::shared_ptr<Event> Record() override;
  void WaitEvent(std::shared_ptr<Event> event) override;
  absl::Status Synchronize(absl::Duration timeout) override;
  absl::Status status() const override;

 private:
  struct Item {
    std::function<absl::Status()> task;  // Skipped when the stream failed.
    std::function<void(const absl::Status&)> on_done;  // Always runs.
  };
  void Push(Item item);
  void Run();

  const std::string name_;
  const absl::Duration wait_timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  absl::Status error_;
  uint64_t next_event_ = 0;
  std::thread worker_;
};

}  // namespace fsdpp

#endif  // FSDPP_CORE_STREAM_H_
