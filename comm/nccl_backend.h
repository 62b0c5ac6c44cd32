// ProcessGroup over NCCL (the CUDA backend; built only with --config=cuda).
//
// Each op enqueues NCCL calls (plus cast / copy kernels where needed) on a
// CUDA stream (the group's comm stream or the caller's) and returns a Work at
// once. Reduce-scatter keeps chunk semantics for any count by padding into a
// scratch buffer; bf16 / f16 reductions are cast to f32, reduced in f32 and
// cast back; all-gather, broadcast and all-to-all move raw bytes.
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0), so no NCCL
// call can hang the process: init, connection setup and every enqueue are
// polled with ncclCommGetAsyncError against a deadline. A watchdog thread per
// group tracks the outstanding ops; when one is not complete by its deadline,
// or NCCL reports an asynchronous error, the watchdog fails it, aborts the
// communicator (ncclCommAbort, which also ends the stuck kernels) and leaves
// the group broken: that op and every later one fail with the same Status,
// naming the op, the NCCL error and the ranks that did not answer (read from
// the heartbeats of comm/heartbeat.h, as in the Gloo backend). A Work's event
// therefore is not the raw CUDA event (which would report success after an
// abort) but a wrapper that reports the op's Status.
//
// Scratch memory comes from the registered CUDA caching allocator (tag
// kCommBuffers) and is owned by the op's record until its CUDA event has
// completed, so no "record stream" is needed.
#ifndef FSDPP_COMM_NCCL_BACKEND_H_
#define FSDPP_COMM_NCCL_BACKEND_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/heartbeat.h"
#include "comm/process_group.h"
#include "comm/store.h"
#include "core/allocator.h"
#include "core/cuda_runtime.h"

// NCCL's communicator type (ncclComm_t is `struct ncclComm*`); declared here
// so that users of this header do not need nccl.h.
struct ncclComm;

namespace fsdpp {

// Settings of an NcclProcessGroup.
struct NcclOptions {
  // Default op timeout (CollectiveOptions::timeout overrides per op; it
  // counts from the issuing call, so it includes waiting for `after`) and the
  // bound for creating the group (join, NCCL id exchange, communicator init)
  // and for finalizing it.
  absl::Duration timeout = absl::Minutes(5);
  // How often the heartbeat is published.
  absl::Duration heartbeat_interval = absl::Milliseconds(250);
};

// The bookkeeping of one issued op (defined in nccl_backend.cc).
struct NcclOpRecord;

// The event of an NCCL op's Work: completes OK when the op's CUDA event
// completes, or with the op's error when the watchdog failed it.
class NcclWorkEvent final : public Event {
 public:
  explicit NcclWorkEvent(std::shared_ptr<NcclOpRecord> op)
      : op_(std::move(op)) {}
  // Event: completion polls the CUDA event; Wait returns the op's Status and
  // name() is the op's description.
  bool IsCompleted() const override;
  absl::Status Wait(absl::Duration timeout) const override;
  std::string name() const override;
  // The CUDA event recorded after the op's kernels (null if the op failed
  // before it was enqueued). A CUDA stream may cudaStreamWaitEvent on it to
  // order work after the op without a host round trip (CudaStream::WaitEvent
  // on this wrapper blocks in a host function instead); the op's Status is
  // only reported through this wrapper.
  std::shared_ptr<CudaEvent> cuda_event() const;
  // cuda_event()'s cudaEvent_t (null likewise); the op record keeps the
  // event alive.
  void* cuda_event_handle() const override;

 private:
  std::shared_ptr<NcclOpRecord> op_;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  // Joins ranks [0, size) of group `name` on GPU `cuda_device` through
  // `store` (not owned; must outlive the group). Rank 0 publishes the NCCL
  // unique id under "<name>/nccl_id"; everyone then initialises a
  // non-blocking communicator. Fails with DeadlineExceeded naming the ranks
  // that did not join, the missing id or the unfinished init when
  // options.timeout passes. Registers the CUDA allocators if needed.
  static absl::StatusOr<std::unique_ptr<NcclProcessGroup>> Create(
      Store* store, int rank, int size, std::string name, int cuda_device,
      NcclOptions options = {});
  // Waits (bounded by the ops' deadlines) for outstanding ops, then finalizes
  // and destroys the communicator (or aborts it if that does not finish).
  ~NcclProcessGroup() override;

  // ProcessGroup accessors; the comm stream is a CudaStream on the group's
  // GPU, owned by the group.
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  Device device() const override { return Device::Cuda(cuda_device_); }
  Stream* comm_stream() override { return stream_.get(); }

  // The collectives of ProcessGroup. CollectiveOptions::stream must be a
  // CudaStream on this group's GPU. Without CollectiveOptions::after, an op
  // is ordered after the work issued so far to the device's legacy default
  // stream (where the tensor ops run), as well as after the host. Issuing
  // may block while NCCL connects to peers (at most the op's timeout). A
  // failure after validation (enqueue error, scratch allocation, timeout)
  // breaks the group and shows in the returned Work, not as an issue error.
  absl::StatusOr<std::shared_ptr<Work>> AllGather(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> ReduceScatter(
      const Buffer& input, const Buffer& output, ReduceOp op,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> AllReduce(
      const Buffer& buffer, ReduceOp op,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> Broadcast(
      const Buffer& buffer, int root,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> AllToAll(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) override;
  // One NCCL group of per-peer sends and receives (zero-size chunks
  // skipped); split sizes are not checked across ranks.
  absl::StatusOr<std::shared_ptr<Work>> AllToAllV(
      const Buffer& input, const std::vector<int64_t>& input_splits,
      const Buffer& output, const std::vector<int64_t>& output_splits,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> Barrier(
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> BatchP2P(
      const std::vector<P2POp>& ops,
      const CollectiveOptions& options = {}) override;

  // The error that broke the group (OK while it is healthy).
  absl::Status status() const;

 private:
  // What an op body gets: the stream, the communicator, NCCL result checks
  // that wait out ncclInProgress, and scratch memory owned by the op.
  struct OpContext;
  using OpBody = std::function<absl::Status(OpContext&)>;

  NcclProcessGroup(Store* store, int rank, int size, std::string name,
                   int cuda_device, NcclOptions options, Allocator* allocator,
                   ncclComm* comm, std::unique_ptr<CudaStream> stream);

  // Assigns the op its sequence number, orders the stream after
  // options.after, runs `body` under comm_mu_ and records the op's event;
  // a failure while enqueuing breaks the group.
  // Blocking ops (options.async_op false) are waited for on the host after
  // comm_mu_ is released.
  // `collective` false (point-to-point): the op takes no group sequence
  // number (the other ranks issue nothing) and does not mark the heartbeat;
  // a failure names the dead peers.
  absl::StatusOr<std::shared_ptr<Work>> Issue(const char* op,
                                              std::string detail,
                                              const CollectiveOptions& options,
                                              OpBody body,
                                              bool collective = true);
  absl::StatusOr<std::shared_ptr<Work>> IssueAsync(
      const char* op, std::string detail, const CollectiveOptions& options,
      OpBody body, bool collective);
  // Makes `stream` wait for `after`, or by default for the legacy default
  // stream; returns the stream's sticky error.
  absl::Status OrderAfter(CudaStream* stream,
                          const std::shared_ptr<Event>& after);
  // The Status failing `op`: "<description> failed (timeout T): <what>;
  // <peer diagnosis>". Blocks for the diagnosis (a few heartbeats).
  absl::Status FailureStatus(const NcclOpRecord& op, absl::StatusCode code,
                             const std::string& what);
  // Marks the group broken with `status`, fails every outstanding op that
  // has not completed, and aborts the communicator. Needs comm_mu_.
  void BreakLocked(const absl::Status& status);
  // Polls outstanding ops for completion, deadlines and NCCL async errors;
  // frees the scratch of failed ops once their kernels are gone.
  void WatchdogLoop();
  void WatchdogCheck(const std::vector<std::shared_ptr<NcclOpRecord>>& ops);
  void Drain(const std::vector<std::shared_ptr<NcclOpRecord>>& ops);

  PrefixStore group_store_;
  const int rank_;
  const int size_;
  const std::string name_;
  const int cuda_device_;
  const NcclOptions options_;
  Allocator* const allocator_;  // Of cuda_device_; process lifetime.
  std::unique_ptr<CudaStream> stream_;
  Heartbeat heartbeat_;

  // Serializes every NCCL call on comm_ (issue, async-error polls, abort,
  // finalize): NCCL communicators are not thread-safe.
  std::mutex comm_mu_;
  ncclComm* comm_;            // Guarded by comm_mu_; null once aborted.
  uint64_t next_seq_ = 0;     // Guarded by comm_mu_.
  uint64_t p2p_batches_ = 0;  // Guarded by comm_mu_.
  // Set before the watchdog takes comm_mu_ to break the group, so an issuer
  // polling ncclInProgress gives the lock up.
  std::atomic<bool> abort_requested_{false};

  mutable std::mutex mu_;  // Guards the fields below.
  std::condition_variable cv_;
  std::vector<std::shared_ptr<NcclOpRecord>> outstanding_;  // Issue order.
  std::vector<std::shared_ptr<NcclOpRecord>>
      draining_;  // Failed, kernels may run.
  absl::Status broken_;
  bool stop_watchdog_ = false;
  std::thread watchdog_;
};

// A factory making NcclProcessGroups on GPU `cuda_device` over `store` (not
// owned), for DeviceMesh.
ProcessGroupFactory NcclGroupFactory(Store* store, int cuda_device,
                                     NcclOptions options = {});

}  // namespace fsdpp

#endif  // FSDPP_COMM_NCCL_BACKEND_H_
