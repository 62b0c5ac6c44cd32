// SharedMemoryCollectives; see shm_collectives.h.
#include "comm/shm_collectives.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/logging.h"
#include "core/status.h"

namespace fsdpp {
namespace {

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "the counters are futex words");

// One counter per cache line: writers of different counters never share one.
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;

uint32_t* Word(std::atomic<uint32_t>* counter) {
  return reinterpret_cast<uint32_t*>(counter);
}

void Wake(std::atomic<uint32_t>* counter) {
  // Shared (not FUTEX_PRIVATE): the waiter may be another process.
  syscall(SYS_futex, Word(counter), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Waits until done(counter's value), sleeping on the counter between
// checks; DeadlineExceeded (saying `what`) at `deadline`.
template <typename Done>
absl::Status WaitFor(std::atomic<uint32_t>* counter, Done done,
                     absl::Time deadline, const char* what, int peer) {
  for (int spin = 0;; ++spin) {
    const uint32_t seen = counter->load(std::memory_order_acquire);
    if (done(seen)) return absl::OkStatus();
    if (spin < 64) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("shared memory: rank ", peer, " has not ", what));
    }
    // Bounded sleeps: a missed wake costs at most this long.
    const timespec ts =
        absl::ToTimespec(std::min(left, absl::Milliseconds(100)));
    syscall(SYS_futex, Word(counter), FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
}

std::string ReadLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string ReadLink(const char* path) {
  char buf[256];
  const ssize_t n = readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

absl::Status ErrnoStatus(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Creates, sizes (reserving the pages: a full /dev/shm fails here, not with
// SIGBUS at the first touch) and maps segment `name`.
absl::StatusOr<void*> CreateSegment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return ErrnoStatus(absl::StrCat("shm_open ", name));
  absl::Status status;
  void* base = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    status = ErrnoStatus(absl::StrCat("ftruncate ", name));
  } else if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
             err != 0) {
    status = absl::UnavailableError(absl::StrCat(
        "reserving ", bytes, " bytes for ", name, ": ", std::strerror(err)));
  } else {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) status = ErrnoStatus(absl::StrCat("mmap ", name));
  }
  close(fd);
  if (!status.ok()) {
    shm_unlink(name.c_str());
    return status;
  }
  return base;
}

absl::StatusOr<void*> OpenSegment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return ErrnoStatus(absl::StrCat("shm_open ", name));
  struct stat st;
  absl::Status status;
  void* base = MAP_FAILED;
  if (fstat(fd, &st) != 0) {
    status = ErrnoStatus(absl::StrCat("fstat ", name));
  } else if (static_cast<size_t>(st.st_size) != bytes) {
    status = absl::FailedPreconditionError(absl::StrCat(
        name, " has ", st.st_size, " bytes, not the expected ", bytes));
  } else {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) status = ErrnoStatus(absl::StrCat("mmap ", name));
  }
  close(fd);
  if (!status.ok()) return status;
  return base;
}

// Every rank's value of `key`/<rank> once all are set.
absl::StatusOr<std::vector<std::string>> AllValues(Store* store,
                                                   const std::string& key,
                                                   int size,
                                                   absl::Duration timeout) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(absl::StrCat(key, "/", r));
  FSDPP_RETURN_IF_ERROR(store->Wait(keys, timeout));
  std::vector<std::string> values;
  for (const std::string& k : keys) {
    FSDPP_ASSIGN_OR_RETURN(std::string v, store->Get(k, timeout));
    values.push_back(std::move(v));
  }
  return values;
}

// The ranks whose value is not "ok", for the fallback's message.
std::string Failures(const std::vector<std::string>& values) {
  std::vector<std::string> failed;
  for (size_t r = 0; r < values.size(); ++r) {
    if (values[r] != "ok") failed.push_back(absl::StrCat(r, ": ", values[r]));
  }
  return absl::StrJoin(failed, "; ");
}

}  // namespace

std::string SharedMemoryCollectives::HostKey() {
  const std::string boot = ReadLine("/proc/sys/kernel/random/boot_id");
  const std::string mnt = ReadLink("/proc/self/ns/mnt");
  const std::string net = ReadLink("/proc/self/ns/net");
  if (boot.empty() || mnt.empty() || net.empty()) return "";
  return absl::StrCat(boot, " ", mnt, " ", net);
}

size_t SharedMemoryCollectives::HeaderBytes(int size) {
  const size_t counters =
      static_cast<size_t>(size) * (1 + static_cast<size_t>(size)) * kLine;
  return (counters + kPage - 1) / kPage * kPage;
}

size_t SharedMemoryCollectives::SegmentBytes(int size) {
  return HeaderBytes(size) + static_cast<size_t>(size) * kSlots * kSlotBytes;
}

absl::StatusOr<std::unique_ptr<SharedMemoryCollectives>>
SharedMemoryCollectives::Connect(Store* store, int rank, int size, bool wanted,
                                 absl::Duration timeout) {
  return Connect(store, rank, size, wanted, timeout,
                 wanted ? HostKey() : std::string());
}

absl::StatusOr<std::unique_ptr<SharedMemoryCollectives>>
SharedMemoryCollectives::Connect(Store* store, int rank, int size, bool wanted,
                                 absl::Duration timeout,
                                 const std::string& host_key) {
  if (size < 2) return nullptr;
  const std::string mine = wanted && !host_key.empty() ? host_key : "-";
  FSDPP_RETURN_IF_ERROR(store->Set(absl::StrCat("shm/host/", rank), mine));
  FSDPP_ASSIGN_OR_RETURN(std::vector<std::string> hosts,
                         AllValues(store, "shm/host", size, timeout));
  for (const std::string& h : hosts) {
    if (h == "-" || h != hosts[0]) return nullptr;
  }
  // One name per group instance: rank 0's pid and a random number.
  std::string token;
  if (rank == 0) {
    std::random_device rd;
    token = absl::StrFormat("%d-%08x%08x", getpid(), rd(), rd());
    FSDPP_RETURN_IF_ERROR(store->Set("shm/token", token));
  } else {
    FSDPP_ASSIGN_OR_RETURN(token, store->Get("shm/token", timeout));
  }
  auto name_of = [&](int r) { return absl::StrCat("/fsdpp-", token, "-", r); };
  const size_t bytes = SegmentBytes(size);
  std::vector<Mapping> segments(size);
  auto unmap = [&]() {
    for (Mapping& m : segments) {
      if (m.base != nullptr) munmap(m.base, m.bytes);
      m.base = nullptr;
    }
  };
  absl::StatusOr<void*> own = CreateSegment(name_of(rank), bytes);
  if (own.ok()) segments[rank] = {*own, bytes};
  // From here on this rank's name exists (if created) until every rank has
  // mapped it or failed: unlinked on every path below.
  auto unlink_own = [&]() {
    if (own.ok()) shm_unlink(name_of(rank).c_str());
  };
  absl::Status s = store->Set(absl::StrCat("shm/made/", rank),
                              own.ok() ? "ok" : own.status().ToString());
  absl::StatusOr<std::vector<std::string>> made =
      s.ok() ? AllValues(store, "shm/made", size, timeout)
             : absl::StatusOr<std::vector<std::string>>(s);
  if (!made.ok()) {
    unlink_own();
    unmap();
    return made.status();
  }
  std::string failure = Failures(*made);
  absl::Status mapped_status;
  if (failure.empty()) {
    for (int r = 0; r < size && mapped_status.ok(); ++r) {
      if (r == rank) continue;
      absl::StatusOr<void*> peer = OpenSegment(name_of(r), bytes);
      if (peer.ok()) {
        segments[r] = {*peer, bytes};
      } else {
        mapped_status = peer.status();
      }
    }
  }
  // Everyone reports (even after a failure above), so no rank waits in vain.
  s = store->Set(absl::StrCat("shm/mapped/", rank),
                 mapped_status.ok() ? "ok" : mapped_status.ToString());
  absl::StatusOr<std::vector<std::string>> mapped =
      s.ok() ? AllValues(store, "shm/mapped", size, timeout)
             : absl::StatusOr<std::vector<std::string>>(s);
  unlink_own();
  if (!mapped.ok()) {
    unmap();
    return mapped.status();
  }
  if (failure.empty()) failure = Failures(*mapped);
  if (!failure.empty()) {
    unmap();
    LOG(WARNING) << "shared memory between ranks failed (" << failure
                 << "); collectives go over TCP";
    return nullptr;
  }
  return std::unique_ptr<SharedMemoryCollectives>(
      new SharedMemoryCollectives(rank, size, std::move(segments)));
}

SharedMemoryCollectives::SharedMemoryCollectives(int rank, int size,
                                                 std::vector<Mapping> segments)
    : rank_(rank),
      size_(size),
      segments_(std::move(segments)),
      written_(size, 0),
      read_(static_cast<size_t>(size) * size, 0) {}

SharedMemoryCollectives::~SharedMemoryCollectives() {
  for (Mapping& m : segments_) {
    if (m.base != nullptr) munmap(m.base, m.bytes);
  }
}

std::atomic<uint32_t>* SharedMemoryCollectives::Published(int w,
                                                          int channel) const {
  char* base = static_cast<char*>(segments_[w].base);
  return reinterpret_cast<std::atomic<uint32_t>*>(base + channel * kLine);
}

std::atomic<uint32_t>* SharedMemoryCollectives::Consumed(int w, int channel,
                                                         int reader) const {
  char* base = static_cast<char*>(segments_[w].base);
  const size_t index = static_cast<size_t>(size_) +
                       static_cast<size_t>(channel) * size_ + reader;
  return reinterpret_cast<std::atomic<uint32_t>*>(base + index * kLine);
}

char* SharedMemoryCollectives::Slot(int w, int channel, uint32_t piece) const {
  return static_cast<char*>(segments_[w].base) + HeaderBytes(size_) +
         (static_cast<size_t>(channel) * kSlots + piece % kSlots) * kSlotBytes;
}

absl::Status SharedMemoryCollectives::AwaitTurn(uint64_t ticket,
                                                absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (turn_ != ticket && broken_.ok()) {
    if (turn_cv_.wait_until(lock, absl::ToChronoTime(deadline)) ==
            std::cv_status::timeout &&
        turn_ != ticket && broken_.ok()) {
      broken_ = absl::DeadlineExceededError(
          absl::StrCat("shared memory: this rank's op #", turn_,
                       " before this one (#", ticket, ") has not finished"));
    }
  }
  if (!broken_.ok()) return broken_;
  return absl::OkStatus();
}

void SharedMemoryCollectives::EndTurn(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!status.ok() && broken_.ok()) broken_ = status;
  ++turn_;
  turn_cv_.notify_all();
}

void SharedMemoryCollectives::Break(absl::Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.ok()) broken_ = std::move(status);
  turn_cv_.notify_all();
}

absl::Status SharedMemoryCollectives::Write(int channel,
                                            const std::vector<int>& readers,
                                            const void* data, size_t bytes,
                                            absl::Time deadline) {
  return Write(channel, readers, bytes, deadline, [&](char* slot) {
    if (bytes > 0) std::memcpy(slot, data, bytes);
  });
}

absl::Status SharedMemoryCollectives::Write(
    int channel, const std::vector<int>& readers, size_t bytes,
    absl::Time deadline, const std::function<void(char*)>& fill) {
  const uint32_t piece = written_[channel];
  for (int p : readers) {
    // The slot is free once reader p has consumed the piece kSlots before.
    FSDPP_RETURN_IF_ERROR(WaitFor(
        Consumed(rank_, channel, p),
        [piece](uint32_t consumed) { return piece - consumed < kSlots; },
        deadline, "read this rank's data", p));
  }
  if (bytes > 0) fill(Slot(rank_, channel, piece));
  written_[channel] = piece + 1;
  Published(rank_, channel)->store(piece + 1, std::memory_order_release);
  Wake(Published(rank_, channel));
  return absl::OkStatus();
}

absl::StatusOr<const char*> SharedMemoryCollectives::Peek(int w, int channel,
                                                          absl::Time deadline) {
  const uint32_t piece = read_[static_cast<size_t>(w) * size_ + channel];
  FSDPP_RETURN_IF_ERROR(WaitFor(
      Published(w, channel),
      [piece](uint32_t published) { return published != piece; }, deadline,
      "written its data", w));
  return Slot(w, channel, piece);
}

void SharedMemoryCollectives::Release(int w, int channel) {
  uint32_t& piece = read_[static_cast<size_t>(w) * size_ + channel];
  ++piece;
  Consumed(w, channel, rank_)->store(piece, std::memory_order_release);
  Wake(Consumed(w, channel, rank_));
}

namespace {

// Spans of memory read or written as one stream of bytes, in order: each
// call moves the stream's next bytes. Char is char (written: an all-gather's
// runs) or const char (read: a reduce-scatter's chunks; null data reads as
// zeros).
template <typename Char>
class SpanCursor {
 public:
  struct Span {
    Char* data;
    size_t bytes;
  };
  explicit SpanCursor(std::vector<Span> spans) : spans_(std::move(spans)) {}

  // The stream's next stretch within one span, at most `most` bytes (> 0):
  // its address (null in a span of zeros) and length. Callers never ask
  // past the stream's end.
  std::pair<Char*, size_t> Next(size_t most) {
    while (index_ < spans_.size() && done_ == spans_[index_].bytes) {
      ++index_;
      done_ = 0;
    }
    if (index_ == spans_.size()) return {nullptr, 0};
    const Span& span = spans_[index_];
    const size_t n = std::min(most, span.bytes - done_);
    Char* at = span.data == nullptr ? nullptr : span.data + done_;
    done_ += n;
    return {at, n};
  }

  // Out of the spans into `to` (a slot).
  void Gather(char* to, size_t bytes) {
    while (bytes > 0) {
      const auto [from, n] = Next(bytes);
      if (n == 0) return;
      if (from == nullptr) {
        std::memset(to, 0, n);
      } else {
        std::memcpy(to, from, n);
      }
      to += n;
      bytes -= n;
    }
  }
  // From `from` (a slot) into the spans.
  void Scatter(const char* from, size_t bytes) {
    while (bytes > 0) {
      const auto [to, n] = Next(bytes);
      if (n == 0) return;
      std::memcpy(to, from, n);
      from += n;
      bytes -= n;
    }
  }

 private:
  std::vector<Span> spans_;
  size_t index_ = 0;  // the span the stream is in
  size_t done_ = 0;   // its bytes already moved
};

// kSlotBytes of zeros, read only (the zero page: no memory of its own).
const char* Zeros() {
  static const char* zeros = [] {
    void* p = mmap(nullptr, SharedMemoryCollectives::kSlotBytes, PROT_READ,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? static_cast<const char*>(
                                 calloc(SharedMemoryCollectives::kSlotBytes, 1))
                           : static_cast<const char*>(p);
  }();
  return zeros;
}

}  // namespace

absl::Status SharedMemoryCollectives::AllGather(uint64_t ticket,
                                                const void* input, void* output,
                                                size_t bytes,
                                                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  FSDPP_RETURN_IF_ERROR(AwaitTurn(ticket, deadline));
  char* out = static_cast<char*>(output);
  if (bytes > 0 && input != out + rank_ * bytes) {
    std::memcpy(out + rank_ * bytes, input, bytes);
  }
  std::vector<std::vector<ByteRun>> runs(size_);
  for (int r = 0; r < size_; ++r) runs[r] = {{r * bytes, bytes}};
  const absl::Status status = GatherRuns(out, runs, deadline);
  EndTurn(status);
  return status;
}

absl::Status SharedMemoryCollectives::AllGatherRuns(
    uint64_t ticket, void* output,
    const std::vector<std::vector<ByteRun>>& runs, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  FSDPP_RETURN_IF_ERROR(AwaitTurn(ticket, deadline));
  const absl::Status status =
      static_cast<int>(runs.size()) == size_
          ? GatherRuns(static_cast<char*>(output), runs, deadline)
          : absl::InvalidArgumentError(
                absl::StrCat("shared memory: ", runs.size(),
                             " lists of runs for ", size_, " ranks"));
  EndTurn(status);
  return status;
}

absl::Status SharedMemoryCollectives::GatherRuns(
    char* output, const std::vector<std::vector<ByteRun>>& runs,
    absl::Time deadline) {
  std::vector<size_t> total(size_, 0);
  size_t most = 0;
  std::vector<SpanCursor<char>> cursors;
  for (int r = 0; r < size_; ++r) {
    std::vector<SpanCursor<char>::Span> spans;
    for (const ByteRun& run : runs[r]) {
      total[r] += run.bytes;
      spans.push_back({output + run.offset, run.bytes});
    }
    cursors.emplace_back(std::move(spans));
    most = std::max(most, (total[r] + kSlotBytes - 1) / kSlotBytes);
  }
  // Piece k of rank r: bytes [k kSlotBytes, ...) of its stream.
  auto length = [&](int r, size_t k) {
    return k * kSlotBytes >= total[r]
               ? size_t{0}
               : std::min(kSlotBytes, total[r] - k * kSlotBytes);
  };
  std::vector<int> readers;
  for (int i = 1; i < size_; ++i) readers.push_back((rank_ + i) % size_);
  for (size_t k = 0; k < most; ++k) {
    if (const size_t len = length(rank_, k); len > 0 && !readers.empty()) {
      FSDPP_RETURN_IF_ERROR(
          Write(rank_, readers, len, deadline,
                [&](char* slot) { cursors[rank_].Gather(slot, len); }));
    }
    for (int w : readers) {
      const size_t len = length(w, k);
      if (len == 0) continue;
      FSDPP_ASSIGN_OR_RETURN(const char* piece, Peek(w, w, deadline));
      cursors[w].Scatter(piece, len);
      Release(w, w);
    }
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryCollectives::ReduceScatter(uint64_t ticket,
                                                    const void* input,
                                                    size_t elem_size, int64_t n,
                                                    absl::Duration timeout,
                                                    const Combine& combine) {
  const char* in = static_cast<const char*>(input);
  const int64_t chunk = (n + size_ - 1) / size_;
  std::vector<std::vector<ByteSpan>> spans(size_);
  for (int q = 0; q < size_; ++q) {
    const int64_t count = std::clamp<int64_t>(n - q * chunk, 0, chunk);
    spans[q] = {
        {in + q * chunk * elem_size, static_cast<size_t>(count) * elem_size}};
  }
  return ReduceScatterSpans(ticket, elem_size, spans, timeout, combine);
}

absl::Status SharedMemoryCollectives::ReduceScatterSpans(
    uint64_t ticket, size_t elem_size,
    const std::vector<std::vector<ByteSpan>>& spans, absl::Duration timeout,
    const Combine& combine) {
  const absl::Time deadline = absl::Now() + timeout;
  FSDPP_RETURN_IF_ERROR(AwaitTurn(ticket, deadline));
  const absl::Status status = [&]() -> absl::Status {
    if (static_cast<int>(spans.size()) != size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("shared memory: ", spans.size(), " lists of spans for ",
                       size_, " ranks"));
    }
    const int64_t per_piece = static_cast<int64_t>(kSlotBytes / elem_size);
    std::vector<int64_t> count(size_, 0);
    std::vector<SpanCursor<const char>> cursors;
    int64_t most = 0;
    for (int q = 0; q < size_; ++q) {
      std::vector<SpanCursor<const char>::Span> chunk;
      for (const ByteSpan& span : spans[q]) {
        count[q] += static_cast<int64_t>(span.bytes / elem_size);
        chunk.push_back({span.data, span.bytes});
      }
      cursors.emplace_back(std::move(chunk));
      most = std::max(most, (count[q] + per_piece - 1) / per_piece);
    }
    auto length = [&](int q, int64_t k) {
      return std::clamp<int64_t>(count[q] - k * per_piece, 0, per_piece);
    };
    std::vector<const char*> pieces(size_);
    std::vector<const void*> sources(size_);
    for (int64_t k = 0; k < most; ++k) {
      // Piece k of chunk q to rank q, for every other q.
      for (int i = 1; i < size_; ++i) {
        const int q = (rank_ + i) % size_;
        const size_t bytes = static_cast<size_t>(length(q, k)) * elem_size;
        if (bytes == 0) continue;
        FSDPP_RETURN_IF_ERROR(Write(q, {q}, bytes, deadline, [&](char* slot) {
          cursors[q].Gather(slot, bytes);
        }));
      }
      const int64_t len = length(rank_, k);
      if (len == 0) continue;
      // Piece k of this rank's chunk from every rank, combined a stretch of
      // this rank's own spans at a time.
      for (int w = 0; w < size_; ++w) {
        if (w == rank_) continue;
        FSDPP_ASSIGN_OR_RETURN(pieces[w], Peek(w, rank_, deadline));
      }
      for (int64_t done = 0; done < len;) {
        const auto [mine, bytes] =
            cursors[rank_].Next(static_cast<size_t>(len - done) * elem_size);
        const int64_t n = static_cast<int64_t>(bytes / elem_size);
        if (n == 0) break;
        for (int w = 0; w < size_; ++w) {
          sources[w] = w == rank_ ? (mine == nullptr ? Zeros() : mine)
                                  : pieces[w] + done * elem_size;
        }
        combine(k * per_piece + done, n, sources.data());
        done += n;
      }
      for (int w = 0; w < size_; ++w) {
        if (w != rank_) Release(w, rank_);
      }
    }
    return absl::OkStatus();
  }();
  EndTurn(status);
  return status;
}

}  // namespace fsdpp
