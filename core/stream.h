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
// cudaStream_t (core/cuda_runtime.h, built under --config=cuda). The host
// thread itself is the CPU "compute stream": host work is complete when
// issued, so HostEvent() is an already-completed event.
//
// Errors are sticky, like CUDA's: when a task fails or a wait times out, the
// stream records the error, skips its remaining work and completes every later
// event with that error, so whoever waits learns what went wrong instead of
// hanging. Every wait has a timeout.
#ifndef FSDPP_CORE_STREAM_H_
#define FSDPP_CORE_STREAM_H_

#include <functional>
#include <memory>
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
  // The cudaEvent_t (as void*) that completes with this event's work, for a
  // CUDA stream to wait on without the host (core/device_wait.h); null when
  // there is none (CPU work, or work not enqueued on a GPU).
  virtual void* cuda_event_handle() const { return nullptr; }
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
//
// Waiters help: a host thread waiting on one of this stream's events runs the
// queued items before that event itself, on its own thread, while the worker
// is idle, each item only if its declared run-time bound fits inside the
// wait's deadline (tasks without a bound always stay on the worker). A host
// that issues an op and waits on it before the worker picked it up so saves
// two thread hand-offs (wake the worker, wake the host), tens to hundreds of
// microseconds on a loaded machine. Order is kept: one item runs at a time
// per stream, whichever thread runs it.
class CpuStream final : public Stream {
 public:
  // `wait_timeout` bounds each WaitEvent on the worker.
  explicit CpuStream(std::string name,
                     absl::Duration wait_timeout = kDefaultStreamWaitTimeout);
  // Runs the work already queued, then stops the worker.
  ~CpuStream() override;
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  // Queues `task`. It runs after all earlier work unless the stream is in the
  // error state, in which case it is skipped. A non-OK return puts the
  // stream in the error state. With a finite `max_runtime` (a bound on how
  // long the task can take, including its own timeouts) a waiter may run it
  // instead of the worker, so the task must not care which thread runs it.
  void Enqueue(std::function<absl::Status()> task,
               absl::Duration max_runtime = absl::InfiniteDuration());

  // Enqueue(task, max_runtime) then Record(), with one wake-up of the worker
  // (none when !wake_worker: then the caller must wait on the event, which
  // runs the items itself or wakes the worker; for blocking ops, which so
  // never switch threads when the stream is idle).
  std::shared_ptr<Event> EnqueueAndRecord(std::function<absl::Status()> task,
                                          absl::Duration max_runtime,
                                          bool wake_worker = true);

  Device device() const override { return Device::Cpu(); }
  const std::string& name() const override;
  std::shared_ptr<Event> Record() override;
  void WaitEvent(std::shared_ptr<Event> event) override;
  absl::Status Synchronize(absl::Duration timeout) override;
  absl::Status status() const override;

  // Queue, worker and helping state, shared with the stream's events (so a
  // waiter can help, or find there is nothing to help, after the stream is
  // gone).
  struct State;

 private:
  std::shared_ptr<State> state_;
  std::thread worker_;
};

}  // namespace fsdpp

#endif  // FSDPP_CORE_STREAM_H_
