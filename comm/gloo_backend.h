// ProcessGroup over Gloo's TCP transport (the CPU backend).
//
// Each op runs as a task on a CpuStream (the group's comm worker thread, or a
// stream the caller passes), using Gloo's ring all-gather / all-reduce,
// broadcast, all-to-all and barrier. Gloo has no reduce-scatter with options,
// so that one is our own ring over Gloo's point-to-point buffers (bandwidth
// optimal, chunk semantics for any count); the uneven all-to-all is our own
// too (it checks the peers' split sizes). bf16 / f16 reductions travel and
// accumulate in f32.
//
// Failure diagnosis: every rank publishes a heartbeat ("op it last started,
// beat counter") under "<group>/heartbeat/<rank>" in the store from a
// background thread. When an op fails or times out, the rank reads its peers'
// heartbeats twice, one beat apart, and names the ranks that have stopped
// (dead) or have not reached the op, so the error says who did not answer
// (comm/heartbeat.h, shared with the NCCL backend).
#ifndef FSDPP_COMM_GLOO_BACKEND_H_
#define FSDPP_COMM_GLOO_BACKEND_H_

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/heartbeat.h"
#include "comm/process_group.h"
#include "comm/shm_collectives.h"
#include "comm/store.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace fsdpp {

struct GlooOptions {
  // Default op timeout (CollectiveOptions::timeout overrides per op) and the
  // bound for joining the group.
  absl::Duration timeout = absl::Minutes(5);
  // Address this rank listens on ("127.0.0.1" for single-host runs).
  std::string hostname = "127.0.0.1";
  // How often the heartbeat is published.
  absl::Duration heartbeat_interval = absl::Milliseconds(250);
  // All-gathers and reduce-scatters through shared memory
  // (comm/shm_collectives.h) when every rank of the group asks for it and
  // shares this host (SharedMemoryCollectives::HostKey); otherwise, or if
  // the segments cannot be made, over TCP as the other ops. The other ops
  // always go over TCP.
  bool shared_memory = false;
};

class GlooProcessGroup final : public ProcessGroup {
 public:
  // Connects ranks [0, size) of group `name` through `store` (not owned;
  // must outlive the group). Every member calls this with the same name and
  // size. Fails with DeadlineExceeded naming the ranks that did not join
  // within options.timeout. If SIGPIPE still has its default action (which
  // would kill the process when a peer dies under a write), it is set to
  // ignored, as Python does; a handler the program installed is kept.
  static absl::StatusOr<std::unique_ptr<GlooProcessGroup>> Create(
      Store* store, int rank, int size, std::string name,
      GlooOptions options = {});
  ~GlooProcessGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  Device device() const override { return Device::Cpu(); }
  Stream* comm_stream() override { return stream_.get(); }

  absl::StatusOr<std::shared_ptr<Work>> AllGather(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) override;
  // Through shared memory only: each piece goes from the writer's runs
  // straight into the readers' (TCP's ring needs rank order).
  bool AllGathersRuns() const override { return shm_ != nullptr; }
  absl::StatusOr<std::shared_ptr<Work>> AllGatherRuns(
      const Buffer& output, const std::vector<std::vector<BufferRun>>& runs,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> ReduceScatter(
      const Buffer& input, const Buffer& output, ReduceOp op,
      const CollectiveOptions& options = {}) override;
  // Through shared memory only: each piece goes from the spans straight into
  // a slot (TCP's ring sends one buffer).
  bool ReduceScattersSpans() const override { return shm_ != nullptr; }
  absl::StatusOr<std::shared_ptr<Work>> ReduceScatterSpans(
      DType dtype, const std::vector<std::vector<BufferSpan>>& spans,
      const Buffer& output, ReduceOp op,
      const CollectiveOptions& options = {}) override;
  // A bf16 / f16 input with an f32 output too: the ring and shared memory
  // widen it piece by piece.
  bool ReduceScatterWidens() const override { return true; }
  absl::StatusOr<std::shared_ptr<Work>> AllReduce(
      const Buffer& buffer, ReduceOp op,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> Broadcast(
      const Buffer& buffer, int root,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> AllToAll(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) override;
  // Our own exchange over Gloo's point-to-point buffers rather than
  // gloo::alltoallv, which aborts the process (an exception on Gloo's event
  // loop thread) when a peer sends more than this rank expects: the split
  // sizes go first (two int64 per peer each way, even when every split is
  // zero), then the non-empty chunks of the pairs that agree.
  absl::StatusOr<std::shared_ptr<Work>> AllToAllV(
      const Buffer& input, const std::vector<int64_t>& input_splits,
      const Buffer& output, const std::vector<int64_t>& output_splits,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> Barrier(
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> BatchP2P(
      const std::vector<P2POp>& ops,
      const CollectiveOptions& options = {}) override;

  // Whether all-gathers and reduce-scatters go through shared memory
  // (GlooOptions::shared_memory, granted).
  bool uses_shared_memory() const { return shm_ != nullptr; }

  // Stops this rank's heartbeat and fails its future ops, as if the process
  // had died: the other ranks' pending ops time out and name this rank. Used
  // by fault tests.
  void SimulateCrash();

  // The underlying Gloo context (for benchmarks comparing against raw Gloo).
  const std::shared_ptr<gloo::Context>& gloo_context() const {
    return context_;
  }

 public:
  class StreamScratch;  // Reused scratch memory of one stream's ops.

 private:
  GlooProcessGroup(Store* store, int rank, int size, std::string name,
                   GlooOptions options, std::shared_ptr<gloo::Context> context,
                   std::unique_ptr<SharedMemoryCollectives> shm);

  using OpBody = std::function<absl::Status(
      uint32_t tag, std::chrono::milliseconds timeout, StreamScratch& scratch)>;
  // Queues `body` on the chosen stream with sequence number, heartbeat
  // bookkeeping, exception translation and failure diagnosis.
  // `sequential_waits` bounds how many blocking waits, each up to the op's
  // timeout, the body can make one after another (for the stream's bound on
  // the task's run time).
  absl::StatusOr<std::shared_ptr<Work>> Issue(const char* op,
                                              std::string detail,
                                              const CollectiveOptions& options,
                                              int sequential_waits,
                                              OpBody body);
  // The same for a point-to-point batch: no group sequence number (the
  // other ranks issue nothing), a failure names the peers that are dead.
  absl::StatusOr<std::shared_ptr<Work>> IssueP2P(
      std::string detail, const CollectiveOptions& options,
      int sequential_waits, OpBody body);
  // Common part: `seq` names the op; `collective` ops mark the heartbeat and
  // diagnose peers against it.
  absl::StatusOr<std::shared_ptr<Work>> IssueOn(
      const char* op, uint64_t seq, bool collective, std::string description,
      const CollectiveOptions& options, int sequential_waits, OpBody body);
  // The stream an op runs on (options.stream or the group's), or
  // InvalidArgument naming `op`.
  absl::StatusOr<CpuStream*> StreamFor(const char* op,
                                       const CollectiveOptions& options);
  // The scratch area of ops on `stream` (created on first use).
  StreamScratch* ScratchFor(const CpuStream* stream);

  Store* const store_;
  PrefixStore group_store_;
  const int rank_;
  const int size_;
  const std::string name_;
  const GlooOptions options_;
  std::shared_ptr<gloo::Context> context_;
  std::unique_ptr<SharedMemoryCollectives> shm_;  // null: TCP only
  std::unique_ptr<CpuStream> stream_;

  std::mutex scratch_mu_;
  std::map<const CpuStream*, std::unique_ptr<StreamScratch>> scratch_;
  std::atomic<uint64_t> next_seq_{0};  // Issue order.
  // Point-to-point: transfers issued to / from each (peer, tag) (they match
  // in order), and batches issued (for messages).
  std::mutex p2p_mu_;
  std::map<std::pair<int, int>, uint64_t> sends_to_, recvs_from_;
  uint64_t p2p_batches_ = 0;
  std::atomic<bool> crashed_{false};
  Heartbeat heartbeat_;
};

// A factory making GlooProcessGroups over `store` (not owned).
ProcessGroupFactory GlooGroupFactory(Store* store, GlooOptions options = {});

// The host scratch a Gloo op allocates beyond its buffers (tag
// kCommBuffers), as the ops below compute it, for planners (plan/):
// `held` bytes stay with the op's stream and only grow (the ring
// reduce-scatter's three chunk buffers, reused by later ops on the stream);
// `transient` bytes live during the op.
struct GlooScratch {
  int64_t held = 0;
  int64_t transient = 0;
};
// `shared_memory`: the group's reduce-scatters go through shared memory
// (no ring buffers held).
GlooScratch GlooReduceScatterScratch(int64_t n, DType dtype, DType out_dtype,
                                     int64_t out_count, int size,
                                     bool shared_memory = false);
GlooScratch GlooAllReduceScratch(int64_t n, DType dtype, int size);
GlooScratch GlooAllToAllScratch(int64_t bytes, bool in_place, int size);

}  // namespace fsdpp

#endif  // FSDPP_COMM_GLOO_BACKEND_H_
