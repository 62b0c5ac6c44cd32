// Liveness heartbeats of a process group's ranks, and the diagnosis of which
// ranks did not answer a failed op. Shared by the Gloo and NCCL backends.
//
// Each rank publishes "<started>,<beat>" under "heartbeat/<rank>" of the
// group's store from a background thread, where <started> is one past the
// sequence number of the last op the rank started and <beat> counts
// publications. When an op fails, DiagnosePeers reads every peer's value
// twice, a few beats apart: a missing value means the rank never beat, an
// unchanged beat means its process is dead or stuck, and an old <started>
// means it is alive but has not reached the op. The store round trips stay off
// the op path: ops only bump an atomic.
#ifndef FSDPP_COMM_HEARTBEAT_H_
#define FSDPP_COMM_HEARTBEAT_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "comm/store.h"

namespace fsdpp {

class Heartbeat {
 public:
  // Starts beating every `interval` into `group_store` (not owned; must
  // outlive this object), which is the group's own prefixed store. `name` is
  // the group's name for log messages.
  Heartbeat(Store* group_store, int rank, int size, std::string name,
            absl::Duration interval);
  // Stops beating and joins the thread.
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // Records that this rank started op `seq` (keeps the maximum: ops may
  // start out of issue order on several streams).
  void MarkStarted(uint64_t seq);
  // Stops publishing; peers then see this rank's heartbeat stop.
  void Stop();
  // Names the peers that did not answer op `seq`: "ranks that did not answer:
  // 2 (heartbeat stopped: process dead or stuck), ..." or "every peer is alive
  // and has reached this op". Blocks for about three intervals.
  std::string DiagnosePeers(uint64_t seq);
  // A bound on how long DiagnosePeers takes (its store reads time out).
  absl::Duration MaxDiagnosisTime() const;

 private:
  void Loop();
  // Publishes beat number `beat`.
  void Beat(uint64_t beat);

  Store* const store_;
  const int rank_;
  const int size_;
  const std::string name_;
  const absl::Duration interval_;
  std::atomic<uint64_t> started_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fsdpp

#endif  // FSDPP_COMM_HEARTBEAT_H_
