// All-gather and reduce-scatter through shared memory between the ranks of
// one host: the transport GlooProcessGroup uses for them when every rank of
// the group shares this host (GlooOptions::shared_memory), in place of
// Gloo's TCP loopback, whose kernel copies and socket threads cost a 2-core
// host's compute (docs/PERFORMANCE.md).
//
// Each rank owns one segment (POSIX shared memory, unlinked once every rank
// has mapped it, so nothing outlives the processes): one channel per rank
// of kSlots slots of kSlotBytes each. Channel `rank` of rank w is its
// broadcast channel (every other rank reads it: all-gather); channel q != w
// goes to rank q alone (reduce-scatter). A writer waits for a slot that every
// reader has consumed, copies a piece into it and publishes it; a reader
// waits for the piece, copies (or reduces) it out and marks it consumed.
// Counters live in the segments, one cache line each, and the waits sleep on
// them as futexes (no spinning on an oversubscribed host), each bounded by
// the op's deadline. Every rank interleaves writing its piece k with reading
// its peers' pieces k, so no wait depends on a later one: no deadlock for
// any number of ranks or size.
//
// Ops run in their issue order (Ticket), whichever stream runs them, so the
// ranks' counters stay matched. A failed op (a timeout) breaks the transport:
// later ops fail at once with its error, as the process group's ops do.
#ifndef FSDPP_COMM_SHM_COLLECTIVES_H_
#define FSDPP_COMM_SHM_COLLECTIVES_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/store.h"

namespace fsdpp {

class SharedMemoryCollectives {
 public:
  static constexpr int kSlots = 4;
  static constexpr size_t kSlotBytes = size_t{1} << 20;

  // This host's identity for sharing memory: the boot id and the mount and
  // network namespaces (ranks in separate network namespaces count as
  // separate hosts, as multi-node runs on one machine do); empty if any of
  // them cannot be read.
  static std::string HostKey();

  // Joins `size` ranks through `store` (keys "shm/..."; a group's own
  // prefix store). Every rank calls it, `wanted` or not. Returns null (use
  // another transport) unless every rank wanted it, all report the same
  // non-empty HostKey() and every rank created and mapped the segments (a
  // full /dev/shm makes all of them fall back together). Errors only from
  // the store (a rank that never arrives: DeadlineExceeded after `timeout`).
  static absl::StatusOr<std::unique_ptr<SharedMemoryCollectives>> Connect(
      Store* store, int rank, int size, bool wanted, absl::Duration timeout);
  // The same with `host_key` in place of HostKey() (tests).
  static absl::StatusOr<std::unique_ptr<SharedMemoryCollectives>> Connect(
      Store* store, int rank, int size, bool wanted, absl::Duration timeout,
      const std::string& host_key);

  ~SharedMemoryCollectives();
  SharedMemoryCollectives(const SharedMemoryCollectives&) = delete;
  SharedMemoryCollectives& operator=(const SharedMemoryCollectives&) = delete;

  // The op's place in the order; taken when the op is issued.
  uint64_t Ticket() { return next_ticket_++; }

  // Every rank's `bytes` from `input` into `output` (bytes * size, in rank
  // order); `input` may be this rank's part of `output`.
  absl::Status AllGather(uint64_t ticket, const void* input, void* output,
                         size_t bytes, absl::Duration timeout);

  // Bytes [offset, offset + bytes) of a buffer.
  struct ByteRun {
    size_t offset = 0;
    size_t bytes = 0;
  };
  // Rank r's bytes are its runs[r] of `output`, in order (this rank's own
  // runs hold its bytes); each lands in the same runs of every other rank's
  // `output`. Every rank passes the same runs (not checked here: the
  // process group validates them).
  absl::Status AllGatherRuns(uint64_t ticket, void* output,
                             const std::vector<std::vector<ByteRun>>& runs,
                             absl::Duration timeout);

  // Rank q's chunk of an n-element input (`elem_size` bytes each) is
  // elements [q c, min(n, (q + 1) c)) with c = ceil(n / size). Each rank
  // sends chunk q of `input` to rank q, and for each piece of its own chunk
  // calls combine(first, count, sources): elements [first, first + count)
  // of the chunk, relative to its start, from every rank in rank order
  // (sources[size()], each pointing at that rank's piece, this rank's in
  // `input`). The pointers are valid during the call only.
  using Combine = std::function<void(int64_t first, int64_t count,
                                     const void* const* sources)>;
  absl::Status ReduceScatter(uint64_t ticket, const void* input,
                             size_t elem_size, int64_t n,
                             absl::Duration timeout, const Combine& combine);

  // `bytes` at `data` in this rank's memory; null data reads as zeros.
  struct ByteSpan {
    const char* data = nullptr;
    size_t bytes = 0;
  };
  // ReduceScatter with rank q's chunk given as spans[q] (bytes a multiple of
  // elem_size), sent as they are: combine is called for each stretch of a
  // piece that lies in one of this rank's own spans (a span of zeros points
  // at zeros). Every rank's spans[q] add up to the same count.
  absl::Status ReduceScatterSpans(
      uint64_t ticket, size_t elem_size,
      const std::vector<std::vector<ByteSpan>>& spans, absl::Duration timeout,
      const Combine& combine);

  // Fails the op waiting for its turn and every later one with `status`
  // (a crashed rank).
  void Break(absl::Status status);

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  struct Mapping {
    void* base = nullptr;
    size_t bytes = 0;
  };
  SharedMemoryCollectives(int rank, int size, std::vector<Mapping> segments);

  // The counters' bytes (a whole number of pages), then the whole segment.
  static size_t HeaderBytes(int size);
  static size_t SegmentBytes(int size);
  // Rank w's counters and slots.
  std::atomic<uint32_t>* Published(int w, int channel) const;
  std::atomic<uint32_t>* Consumed(int w, int channel, int reader) const;
  char* Slot(int w, int channel, uint32_t piece) const;

  // Waits until it is `ticket`'s turn; the guard ends the turn.
  absl::Status AwaitTurn(uint64_t ticket, absl::Time deadline);
  void EndTurn(const absl::Status& status);

  // AllGatherRuns in this op's turn.
  absl::Status GatherRuns(char* output,
                          const std::vector<std::vector<ByteRun>>& runs,
                          absl::Time deadline);

  // Writes `bytes` (<= kSlotBytes) as the next piece of this rank's channel
  // `channel`, read by `readers`: fill(slot) puts them into the slot.
  absl::Status Write(int channel, const std::vector<int>& readers, size_t bytes,
                     absl::Time deadline,
                     const std::function<void(char*)>& fill);
  absl::Status Write(int channel, const std::vector<int>& readers,
                     const void* data, size_t bytes, absl::Time deadline);
  // The next piece of rank w's channel `channel` (this rank reads it); call
  // Release after using it.
  absl::StatusOr<const char*> Peek(int w, int channel, absl::Time deadline);
  void Release(int w, int channel);

  const int rank_;
  const int size_;
  std::vector<Mapping> segments_;  // by rank
  // Pieces this rank has written per channel, and read per (writer,
  // channel): the counters' values as this rank last set them.
  std::vector<uint32_t> written_;
  std::vector<uint32_t> read_;  // [writer * size + channel]
  std::atomic<uint64_t> next_ticket_{0};
  std::mutex mu_;
  std::condition_variable turn_cv_;
  uint64_t turn_ = 0;
  absl::Status broken_;
};

}  // namespace fsdpp

#endif  // FSDPP_COMM_SHM_COLLECTIVES_H_
