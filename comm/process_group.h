// Collectives on raw device buffers: the backend-neutral ProcessGroup and its
// asynchronous Work handles.
//
// Every op is described by plain buffers (pointer, element count, dtype,
// device) and returns a Work at once; the data moves on a comm stream. The op
// is ordered after `CollectiveOptions::after` (an event of the caller's
// stream; by default the host, i.e. everything issued before the call), runs
// on `CollectiveOptions::stream` (default: the group's own comm stream) and
// completes Work::event(), which the caller's stream or the host waits on.
// That is how FSDP overlaps all-gathers and reduce-scatters with compute.
//
// Ops must be issued in the same order on every rank of a group (they are
// matched by sequence number). Every op has a timeout; a missing or dead peer
// fails the op with a Status naming the op, the group and the ranks that did
// not answer, and leaves the group broken (later ops fail fast with the same
// error), as NCCL's abort semantics do. Argument errors are returned from the
// issuing call itself.
#ifndef FSDPP_COMM_PROCESS_GROUP_H_
#define FSDPP_COMM_PROCESS_GROUP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/stream.h"

namespace fsdpp {

// A contiguous buffer of `count` elements of `dtype` on `device`.
struct Buffer {
  void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::kF32;
  Device device = Device::Cpu();

  size_t nbytes() const {
    return static_cast<size_t>(count) * DTypeSize(dtype);
  }
  std::string ToString() const;
};

// Elements [offset, offset + count) of a buffer.
struct BufferRun {
  int64_t offset = 0;
  int64_t count = 0;
};

// `count` elements at `data` in this rank's memory; null data stands for
// zeros.
struct BufferSpan {
  const void* data = nullptr;
  int64_t count = 0;
};

// The elements of a list of runs or spans, and of lists of them.
template <typename Part>
int64_t ElementsIn(const std::vector<Part>& parts) {
  int64_t n = 0;
  for (const Part& part : parts) n += part.count;
  return n;
}
template <typename Part>
int64_t ElementsIn(const std::vector<std::vector<Part>>& lists) {
  int64_t n = 0;
  for (const std::vector<Part>& parts : lists) n += ElementsIn(parts);
  return n;
}

// How reductions combine values. kAvg divides the sum by the group size and
// needs a float dtype. bf16 / f16 reduce with f32 accumulation.
enum class ReduceOp { kSum, kAvg, kMax };
const char* ReduceOpName(ReduceOp op);

struct CollectiveOptions {
  // Op timeout; zero means the group's default.
  absl::Duration timeout = absl::ZeroDuration();
  // The op starts after this event completes (null: after the issuing call).
  std::shared_ptr<Event> after;
  // The stream the op runs on (null: the group's comm stream). Gloo groups
  // need a CpuStream.
  Stream* stream = nullptr;
  // False: a blocking op, like torch.distributed's default async_op=False;
  // the call returns once the op has finished (its Work is complete, Wait
  // gives its status). Gloo runs it on the calling thread when its stream has
  // nothing queued before it, so it costs no thread hand-offs; NCCL issues it
  // and waits for it on the host.
  bool async_op = true;
};

// One transfer of a point-to-point batch (ProcessGroup::BatchP2P).
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  Buffer buffer;
  int peer = 0;  // the destination of a send, the source of a receive
  // Transfers between two ranks match in order per tag (0 .. kMaxP2PTag):
  // the n-th send from a to b with tag t matches the n-th receive on b from
  // a with tag t, whatever the transfers with other tags do in between
  // (pipeline stages keep activations and gradients apart this way). The
  // NCCL backend matches in issue order and takes tag 0 only.
  int tag = 0;
  static constexpr int kMaxP2PTag = (1 << 20) - 1;

  static P2POp Send(const Buffer& buffer, int dst, int tag = 0) {
    return {Kind::kSend, buffer, dst, tag};
  }
  static P2POp Recv(const Buffer& buffer, int src, int tag = 0) {
    return {Kind::kRecv, buffer, src, tag};
  }
};

// The handle of an issued collective.
class Work {
 public:
  Work(std::string description, std::shared_ptr<Event> event)
      : description_(std::move(description)), event_(std::move(event)) {}

  // Blocks the host until the op finished; returns its Status, or
  // DeadlineExceeded naming the op if it is still running after `timeout`.
  // On a CPU stream, a waiter may run the op (and what is queued before it)
  // itself when the comm thread has not started it yet and the op's time
  // bound fits inside `timeout` (core/stream.h).
  absl::Status Wait(absl::Duration timeout = absl::Minutes(30)) const;
  // Orders the work that the host enqueues on `compute` from now on after
  // this op. On a CUDA device, when the op's event is a CUDA event, the
  // device's compute stream waits on it and the host goes on at once (as
  // FSDP2 waits for its collectives); the op's own error then surfaces at a
  // later host wait on it or on its group. Otherwise the host waits, as
  // Wait(timeout).
  absl::Status WaitForCompute(Device compute,
                              absl::Duration timeout = absl::Minutes(30)) const;
  bool IsCompleted() const { return event_->IsCompleted(); }
  // Completes when the op's data is in place: a stream's WaitEvent target.
  const std::shared_ptr<Event>& event() const { return event_; }
  // "all_gather #12 on group 'dp' (1024 x f32)".
  const std::string& description() const { return description_; }

 private:
  std::string description_;
  std::shared_ptr<Event> event_;
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;
  // The device its buffers live on (cpu for Gloo, cuda:N for NCCL).
  virtual Device device() const = 0;
  // The group's default comm stream.
  virtual Stream* comm_stream() = 0;

  // Every rank's `input` (count c) into `output` (count c * size), in rank
  // order. In place when input.data == output.data + rank * c bytes.
  virtual absl::StatusOr<std::shared_ptr<Work>> AllGather(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) = 0;

  // An all-gather whose ranks' parts lie in runs of `output` instead of in
  // rank order: rank r's part is the elements of runs[r] (in order), which
  // rank r's own runs of `output` hold when it issues the op; every rank
  // passes the same runs, and the op fills each rank's runs of every other
  // rank's output. Runs are [offset, offset + count) in elements; they lie in
  // `output` and do not overlap; the elements outside them are not touched.
  // FSDP gathers parameters with it straight into their own layout, where
  // AllGather's rank order needs a copy-out. Only where AllGathersRuns();
  // Unimplemented elsewhere.
  virtual bool AllGathersRuns() const { return false; }
  virtual absl::StatusOr<std::shared_ptr<Work>> AllGatherRuns(
      const Buffer& output, const std::vector<std::vector<BufferRun>>& runs,
      const CollectiveOptions& options = {});

  // Reduces `input` (count n, any n) across ranks and leaves this rank's
  // chunk in `output`: chunk = ceil(n / size), rank r gets elements
  // [r * chunk, min(n, (r + 1) * chunk)) (possibly none), so output.count must
  // be ReduceScatterCount(n, size, rank). The output's dtype is the input's,
  // or f32 for a bf16 / f16 input where ReduceScatterWidens().
  virtual absl::StatusOr<std::shared_ptr<Work>> ReduceScatter(
      const Buffer& input, const Buffer& output, ReduceOp op,
      const CollectiveOptions& options = {}) = 0;

  // A reduce-scatter whose input is spans of this rank's memory (on the
  // group's device) instead of one buffer: the chunk that rank q reduces into
  // its `output` is the concatenation of spans[q], elements of `dtype`. Every
  // rank's spans[q] add up to rank q's output count; the spans must stay
  // valid until the op completes. Dtypes, reduction and result as
  // ReduceScatter. FSDP hands over its gradients with it as they are, where
  // ReduceScatter needs them copied into one buffer first. Only where
  // ReduceScattersSpans(); Unimplemented elsewhere.
  virtual bool ReduceScattersSpans() const { return false; }
  virtual absl::StatusOr<std::shared_ptr<Work>> ReduceScatterSpans(
      DType dtype, const std::vector<std::vector<BufferSpan>>& spans,
      const Buffer& output, ReduceOp op, const CollectiveOptions& options = {});

  // Reduces `buffer` across ranks, in place.
  virtual absl::StatusOr<std::shared_ptr<Work>> AllReduce(
      const Buffer& buffer, ReduceOp op,
      const CollectiveOptions& options = {}) = 0;

  // Copies `root`'s `buffer` into every rank's `buffer`.
  virtual absl::StatusOr<std::shared_ptr<Work>> Broadcast(
      const Buffer& buffer, int root,
      const CollectiveOptions& options = {}) = 0;

  // Splits `input` into size equal chunks; chunk j goes to rank j, and
  // `output` chunk i comes from rank i. count % size must be 0.
  virtual absl::StatusOr<std::shared_ptr<Work>> AllToAll(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) = 0;

  // All-to-all with uneven chunks (MoE token dispatch; torch's
  // all_to_all_single with split sizes). `input` is size() chunks in rank
  // order, chunk j (input_splits[j] elements) going to rank j; `output` chunk
  // i (output_splits[i] elements) comes from rank i, in rank order. Splits
  // count elements, not bytes, and sum to the buffers' counts. Zero-size
  // chunks move nothing. Input and output must not overlap (unless one is
  // empty). input_splits[j] on rank r must equal output_splits[r] on rank j;
  // a mismatch is the caller's error. Gloo checks it (the split sizes travel
  // first): both ranks of a disagreeing pair fail the op at once with
  // InvalidArgument naming each other, having moved nothing between them, and
  // the other transfers complete; as any failed op, it breaks the group on
  // those two ranks. NCCL does not check: the op may fail at its timeout or
  // leave the chunk wrong.
  virtual absl::StatusOr<std::shared_ptr<Work>> AllToAllV(
      const Buffer& input, const std::vector<int64_t>& input_splits,
      const Buffer& output, const std::vector<int64_t>& output_splits,
      const CollectiveOptions& options = {}) = 0;

  // Whether ReduceScatter takes a bf16 / f16 input with an f32 output. The
  // sums are f32 either way, so the result has the bits of an f32 input
  // holding the same values; FSDP then hands over bf16 gradients as they
  // are (half the bytes to copy and move). Gloo does (its reductions widen
  // piece by piece); NCCL does not (its f32 reduction needs a whole f32
  // copy of the input, more memory than FSDP's own f32 buffer).
  virtual bool ReduceScatterWidens() const { return false; }

  // Completes once every rank has reached it.
  virtual absl::StatusOr<std::shared_ptr<Work>> Barrier(
      const CollectiveOptions& options = {}) = 0;

  // Point-to-point (pipeline parallelism): the sends and receives of `ops`
  // as one op, all in flight together (so a rank can send to its successor
  // while receiving from its predecessor), complete when all are. Only the
  // ranks named take part; the other ranks of the group issue nothing, and
  // the collectives' order is not affected. The n-th send from rank a to
  // rank b matches the n-th receive on b from a, which must have the same
  // byte size; zero-size transfers move nothing. A peer that is dead or
  // never posts its side fails the op after the timeout, naming it. Peers
  // must be other ranks of the group.
  virtual absl::StatusOr<std::shared_ptr<Work>> BatchP2P(
      const std::vector<P2POp>& ops, const CollectiveOptions& options = {}) = 0;
  // One send / one receive (tag 0).
  absl::StatusOr<std::shared_ptr<Work>> Send(
      const Buffer& buffer, int dst, const CollectiveOptions& options = {}) {
    return BatchP2P({P2POp::Send(buffer, dst)}, options);
  }
  absl::StatusOr<std::shared_ptr<Work>> Recv(
      const Buffer& buffer, int src, const CollectiveOptions& options = {}) {
    return BatchP2P({P2POp::Recv(buffer, src)}, options);
  }
};

// Makes (and connects) the process group `name` with this rank at position
// `rank` of `size`; every member calls it with the same arguments but its own
// rank. DeviceMesh builds its per-axis groups through one of these.
using ProcessGroupFactory =
    std::function<absl::StatusOr<std::unique_ptr<ProcessGroup>>(
        const std::string& name, int rank, int size)>;

// Elements of rank `rank`'s chunk of `n` split `size` ways (chunk semantics).
int64_t ReduceScatterCount(int64_t n, int size, int rank);
// Offset of that chunk.
int64_t ReduceScatterOffset(int64_t n, int size, int rank);

// Validation shared by the backends: InvalidArgument naming op and group.
absl::Status ValidateAllGather(const ProcessGroup& group, const Buffer& input,
                               const Buffer& output);
// Also: one list of runs per rank, each run inside `output`, none
// overlapping another.
absl::Status ValidateAllGatherRuns(
    const ProcessGroup& group, const Buffer& output,
    const std::vector<std::vector<BufferRun>>& runs);
absl::Status ValidateReduceScatter(const ProcessGroup& group,
                                   const Buffer& input, const Buffer& output,
                                   ReduceOp op);
// Also: one list of spans per rank, no negative count, this rank's adding up
// to the output's count.
absl::Status ValidateReduceScatterSpans(
    const ProcessGroup& group, DType dtype,
    const std::vector<std::vector<BufferSpan>>& spans, const Buffer& output,
    ReduceOp op);
absl::Status ValidateAllReduce(const ProcessGroup& group, const Buffer& buffer,
                               ReduceOp op);
absl::Status ValidateBroadcast(const ProcessGroup& group, const Buffer& buffer,
                               int root);
absl::Status ValidateAllToAll(const ProcessGroup& group, const Buffer& input,
                              const Buffer& output);
// Also that input_splits[rank] == output_splits[rank] (the chunk a rank
// keeps), the one cross-rank rule a rank can check alone.
absl::Status ValidateAllToAllV(const ProcessGroup& group, const Buffer& input,
                               const std::vector<int64_t>& input_splits,
                               const Buffer& output,
                               const std::vector<int64_t>& output_splits);
absl::Status ValidateP2P(const ProcessGroup& group,
                         const std::vector<P2POp>& ops);
// "send 4 x f32 to 1, recv 4 x f32 from 2".
std::string P2PDetail(const std::vector<P2POp>& ops);
// "send [2, 0, 1], recv [1, 1, 0] x f32" (an all_to_all_v's splits).
std::string AllToAllVDetail(DType dtype,
                            const std::vector<int64_t>& input_splits,
                            const std::vector<int64_t>& output_splits);

}  // namespace fsdpp

#endif  // FSDPP_COMM_PROCESS_GROUP_H_
