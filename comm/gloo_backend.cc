// Gloo process group; see gloo_backend.h.
#include "comm/gloo_backend.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/allocator.h"
#include "core/logging.h"
#include "core/status.h"
#include "core/trace.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoall.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/types.h"

namespace fsdpp {
namespace {

// Slot prefix of our ring reduce-scatter (Gloo's own prefixes are 0x01-0x08).
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;
// Point-to-point transfers (their own per-pair numbering).
constexpr uint8_t kP2PSlotPrefix = 0x41;
// all_to_all_v: its split sizes (slot + 0), then its chunks (slot + 1).
constexpr uint8_t kAllToAllVSlotPrefix = 0x42;

// Carries a Status through Gloo's exception-based rendezvous code.
struct StoreError : public std::exception {
  explicit StoreError(absl::Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return "store error"; }
  absl::Status status;
};

// Gloo's Store interface over ours; the timeout bounds every wait.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(fsdpp::Store* store, absl::Duration timeout)
      : store_(store), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s =
        store_->Set(key, absl::string_view(data.data(), data.size()));
    if (!s.ok()) throw StoreError(s);
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> v = store_->Get(key, timeout_);
    if (!v.ok()) throw StoreError(v.status());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override {
    absl::Status s = store_->Wait(keys, timeout_);
    if (!s.ok()) throw StoreError(s);
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds&) override {
    wait(keys);
  }

 private:
  fsdpp::Store* store_;
  absl::Duration timeout_;
};

// One Gloo TCP device (listening socket + event loop) per address, shared by
// every group of the process.
absl::StatusOr<std::shared_ptr<gloo::transport::Device>> DeviceFor(
    const std::string& hostname) {
  static std::mutex* mu = new std::mutex;
  static auto* devices =
      new std::map<std::string, std::shared_ptr<gloo::transport::Device>>;
  std::lock_guard<std::mutex> lock(*mu);
  auto it = devices->find(hostname);
  if (it != devices->end()) return it->second;
  try {
    gloo::transport::tcp::attr attr(hostname.c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    devices->emplace(hostname, device);
    return device;
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "gloo: cannot create a TCP device on '", hostname, "': ", e.what()));
  }
}

std::chrono::milliseconds ToMillis(absl::Duration d) {
  return std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// Host scratch memory accounted as comm buffers.
class Scratch {
 public:
  static absl::StatusOr<Scratch> Allocate(size_t bytes) {
    Scratch s;
    s.bytes_ = bytes;
    FSDPP_ASSIGN_OR_RETURN(
        s.ptr_,
        GetAllocator(Device::Cpu())->Allocate(bytes, MemoryTag::kCommBuffers));
    return s;
  }
  Scratch() = default;
  Scratch(Scratch&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
  }
  Scratch& operator=(Scratch&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~Scratch() {
    if (ptr_ != nullptr) {
      GetAllocator(Device::Cpu())
          ->Deallocate(ptr_, bytes_, MemoryTag::kCommBuffers);
    }
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

void ToF32(const Buffer& b, float* out, int64_t begin, int64_t end) {
  if (b.dtype == DType::kBF16) {
    const BFloat16* p = static_cast<const BFloat16*>(b.data);
    for (int64_t i = begin; i < end; ++i)
      out[i - begin] = BFloat16ToFloat(p[i]);
  } else if (b.dtype == DType::kF16) {
    const Float16* p = static_cast<const Float16*>(b.data);
    for (int64_t i = begin; i < end; ++i) out[i - begin] = Float16ToFloat(p[i]);
  } else {
    std::memcpy(out, static_cast<const float*>(b.data) + begin,
                (end - begin) * sizeof(float));
  }
}

void FromF32(const float* in, int64_t n, const Buffer& b) {
  if (b.dtype == DType::kBF16) {
    BFloat16* p = static_cast<BFloat16*>(b.data);
    for (int64_t i = 0; i < n; ++i) p[i] = FloatToBFloat16(in[i]);
  } else if (b.dtype == DType::kF16) {
    Float16* p = static_cast<Float16*>(b.data);
    for (int64_t i = 0; i < n; ++i) p[i] = FloatToFloat16(in[i]);
  } else {
    std::memcpy(b.data, in, n * sizeof(float));
  }
}

using GlooReduceFn = void (*)(void*, const void*, const void*, size_t);

template <typename T>
GlooReduceFn ReduceFunction(ReduceOp op) {
  GlooReduceFn max = &gloo::max<T>;
  GlooReduceFn sum = &gloo::sum<T>;
  return op == ReduceOp::kMax ? max : sum;
}

}  // namespace

// A scratch area that grows and is reused across ops, accounted as comm
// buffers while it lives. One per stream: the ops of a stream never run at
// the same time (but not always on the same thread: waiters may run them).
class GlooProcessGroup::StreamScratch {
 public:
  // At least `bytes` bytes, valid until the next call.
  absl::StatusOr<char*> Get(size_t bytes) {
    if (bytes > capacity_) {
      buffer_ = Scratch();
      FSDPP_ASSIGN_OR_RETURN(buffer_, Scratch::Allocate(bytes));
      capacity_ = bytes;
    }
    return buffer_.as<char>();
  }

 private:
  Scratch buffer_;
  size_t capacity_ = 0;
};

namespace {

// Bytes of one of the ring reduce-scatter's three accumulator buffers: a
// chunk of ceil(n / size) elements of `acc_size` bytes (at least one).
size_t RingChunkBytes(int64_t n, int size, size_t acc_size) {
  const int64_t chunk = (n + size - 1) / size;
  return std::max<int64_t>(1, chunk) * acc_size;
}

// Loads elements [begin, begin + n) of `in` (dtype `dtype`) as Acc.
template <typename Acc>
void LoadAs(const void* in, DType dtype, int64_t begin, int64_t n, Acc* out) {
  if constexpr (std::is_same_v<Acc, float>) {
    if (dtype == DType::kBF16) {
      const BFloat16* p = static_cast<const BFloat16*>(in) + begin;
      for (int64_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(p[i]);
      return;
    }
    if (dtype == DType::kF16) {
      const Float16* p = static_cast<const Float16*>(in) + begin;
      for (int64_t i = 0; i < n; ++i) out[i] = Float16ToFloat(p[i]);
      return;
    }
  }
  // memcpy's pointers must be valid even for 0 bytes (an empty op's
  // buffers may be null).
  if (n > 0) {
    std::memcpy(out, static_cast<const Acc*>(in) + begin, n * sizeof(Acc));
  }
}

// out = combine(acc, in[begin, begin + n)) with `in` of dtype `dtype`
// (out may be acc).
template <typename Acc>
void CombineFrom(Acc* out, const Acc* acc, const void* in, DType dtype,
                 int64_t begin, int64_t n, ReduceOp op) {
  if constexpr (std::is_same_v<Acc, float>) {
    if (dtype == DType::kBF16 || dtype == DType::kF16) {
      const bool bf16 = dtype == DType::kBF16;
      const uint16_t* p = static_cast<const uint16_t*>(in) + begin;
      for (int64_t i = 0; i < n; ++i) {
        const float v = bf16 ? BFloat16ToFloat(BFloat16::FromBits(p[i]))
                             : Float16ToFloat(Float16::FromBits(p[i]));
        out[i] = op == ReduceOp::kMax ? std::max(acc[i], v) : acc[i] + v;
      }
      return;
    }
  }
  const Acc* p = static_cast<const Acc*>(in) + begin;
  if (op == ReduceOp::kMax) {
    for (int64_t i = 0; i < n; ++i) out[i] = std::max(acc[i], p[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = acc[i] + p[i];
  }
}

// Ring reduce-scatter of `n` elements of `in` (dtype `dtype`, accumulated as
// Acc: f32 for float dtypes) into `result` (this rank's chunk, as Acc). The
// input is only read: step 0 sends this rank's own piece straight from it
// (converted first when its dtype is not Acc), every later step forwards the
// running sum it just completed (double-buffered), and the last step adds
// straight into `result`. Data moved: (size - 1) / size of n each way.
template <typename Acc>
absl::Status RingReduceScatter(gloo::Context& context, const void* in,
                               DType dtype, int64_t n, ReduceOp op,
                               uint32_t tag, std::chrono::milliseconds timeout,
                               GlooProcessGroup::StreamScratch& scratch_area,
                               Acc* result) {
  // One deadline for the whole op (not per step), so its run time is bounded
  // by `timeout` as Issue declares.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left = [&deadline] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  const int size = context.size, rank = context.rank;
  const int64_t chunk = (n + size - 1) / size;
  auto seg_begin = [&](int i) { return std::min(n, i * chunk); };
  auto seg_len = [&](int i) {
    return std::min(n, (i + 1) * chunk) - seg_begin(i);
  };
  if (size == 1) {
    LoadAs<Acc>(in, dtype, 0, n, result);
    return absl::OkStatus();
  }
  const size_t chunk_bytes = RingChunkBytes(n, size, sizeof(Acc));
  FSDPP_ASSIGN_OR_RETURN(char* scratch, scratch_area.Get(3 * chunk_bytes));
  Acc* bufs[3] = {reinterpret_cast<Acc*>(scratch),
                  reinterpret_cast<Acc*>(scratch + chunk_bytes),
                  reinterpret_cast<Acc*>(scratch + 2 * chunk_bytes)};
  std::unique_ptr<gloo::transport::UnboundBuffer> ub[3];
  for (int b = 0; b < 3; ++b) {
    ub[b] = context.createUnboundBuffer(bufs[b], chunk * sizeof(Acc));
  }
  // Step 0 sends this rank's piece of the input itself when no conversion is
  // needed (Gloo only reads it).
  const int first = ((rank - 1) % size + size) % size;
  const bool native = DTypeSize(dtype) == sizeof(Acc) &&
                      (std::is_integral_v<Acc> || dtype == DType::kF32);
  std::unique_ptr<gloo::transport::UnboundBuffer> input_ub;
  if (native) {
    input_ub = context.createUnboundBuffer(
        const_cast<Acc*>(static_cast<const Acc*>(in)) + seg_begin(first),
        seg_len(first) * sizeof(Acc));
  } else {
    LoadAs<Acc>(in, dtype, seg_begin(first), seg_len(first), bufs[2]);
  }
  gloo::transport::UnboundBuffer* send_ub =
      native ? input_ub.get() : ub[2].get();
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  const auto base = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
  for (int step = 0; step < size - 1; ++step) {
    const int send_idx = ((rank - step - 1) % size + size) % size;
    const int recv_idx = ((rank - step - 2) % size + size) % size;
    const bool last = step == size - 2;
    const int recv_buf = step % 2;
    const uint64_t slot = base + static_cast<uint8_t>(step % 256);
    const int64_t send_len = seg_len(send_idx), recv_len = seg_len(recv_idx);
    if (send_len > 0) send_ub->send(next, slot, 0, send_len * sizeof(Acc));
    if (recv_len > 0) {
      ub[recv_buf]->recv(prev, slot, 0, recv_len * sizeof(Acc));
      if (!ub[recv_buf]->waitRecv(nullptr, left())) {
        return absl::DeadlineExceededError(absl::StrCat(
            "receive from rank ", prev, " (ring step ", step, ") failed"));
      }
      // The last piece received is this rank's own chunk: add into result.
      CombineFrom(last ? result : bufs[recv_buf], bufs[recv_buf], in, dtype,
                  seg_begin(recv_idx), recv_len, op);
    }
    if (send_len > 0 && !send_ub->waitSend(nullptr, left())) {
      return absl::DeadlineExceededError(absl::StrCat(
          "send to rank ", next, " (ring step ", step, ") failed"));
    }
    send_ub = ub[recv_buf].get();
  }
  return absl::OkStatus();
}

// Uneven all-to-all over Gloo's point-to-point buffers (see
// ProcessGroup::AllToAllV). First every pair of ranks swaps what each sends
// the other and expects from it (two int64 each way); a pair whose numbers
// disagree moves no data (Gloo would abort the process on a chunk larger
// than the receive posted for it), and both its ranks fail with
// InvalidArgument naming the other once their other chunks have moved, so
// no peer is left waiting. Then the non-empty chunks of the agreeing pairs
// move, all in flight together. One deadline for the whole op.
absl::Status AllToAllVExchange(gloo::Context& context, const Buffer& input,
                               const std::vector<int64_t>& input_splits,
                               const Buffer& output,
                               const std::vector<int64_t>& output_splits,
                               uint32_t tag,
                               std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left = [&deadline] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  const int size = context.size, rank = context.rank;
  const size_t elem = DTypeSize(input.dtype);
  // Byte offsets of each rank's chunk.
  std::vector<size_t> in_off(size + 1, 0), out_off(size + 1, 0);
  for (int p = 0; p < size; ++p) {
    in_off[p + 1] = in_off[p] + input_splits[p] * elem;
    out_off[p + 1] = out_off[p] + output_splits[p] * elem;
  }
  auto bytes_in = [&](int p) { return in_off[p + 1] - in_off[p]; };
  auto bytes_out = [&](int p) { return out_off[p + 1] - out_off[p]; };
  // This rank's own chunk (validated: the same size both ways).
  if (bytes_in(rank) > 0) {
    std::memcpy(static_cast<char*>(output.data) + out_off[rank],
                static_cast<const char*>(input.data) + in_off[rank],
                bytes_in(rank));
  }
  if (size == 1) return absl::OkStatus();
  // Waits for `n` completed sends (or receives) of `ub`.
  auto wait = [&](gloo::transport::UnboundBuffer& ub, bool send, int n,
                  const char* what) -> absl::Status {
    for (int i = 0; i < n; ++i) {
      try {
        const bool ok =
            send ? ub.waitSend(nullptr, left()) : ub.waitRecv(nullptr, left());
        if (!ok) {
          return absl::DeadlineExceededError(
              absl::StrCat(what, " did not complete"));
        }
      } catch (const std::exception& e) {
        return absl::DeadlineExceededError(
            absl::StrCat(what, " did not complete: ", e.what()));
      }
    }
    return absl::OkStatus();
  };
  const gloo::Slot base = gloo::Slot::build(kAllToAllVSlotPrefix, tag);
  // Phase 1: [what I send you, what I expect from you] to every peer.
  std::vector<int64_t> mine(2 * size), theirs(2 * size, -1);
  for (int p = 0; p < size; ++p) {
    mine[2 * p] = input_splits[p];
    mine[2 * p + 1] = output_splits[p];
  }
  constexpr size_t kPair = 2 * sizeof(int64_t);
  auto mine_ub =
      context.createUnboundBuffer(mine.data(), mine.size() * sizeof(int64_t));
  auto theirs_ub = context.createUnboundBuffer(theirs.data(),
                                               theirs.size() * sizeof(int64_t));
  for (int i = 1; i < size; ++i) {
    const int to = (rank + i) % size, from = (rank + size - i) % size;
    mine_ub->send(to, base, to * kPair, kPair);
    theirs_ub->recv(from, base, from * kPair, kPair);
  }
  FSDPP_RETURN_IF_ERROR(
      wait(*mine_ub, true, size - 1, "sending the split sizes"));
  FSDPP_RETURN_IF_ERROR(
      wait(*theirs_ub, false, size - 1, "receiving the split sizes"));
  std::vector<bool> agree(size, true);
  std::vector<std::string> disagreements;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const int64_t sends_me = theirs[2 * p], expects = theirs[2 * p + 1];
    if (sends_me == output_splits[p] && expects == input_splits[p]) continue;
    agree[p] = false;
    std::string d = absl::StrCat("rank ", p);
    if (sends_me != output_splits[p]) {
      absl::StrAppend(&d, " sends ", sends_me, " elements, output_splits[", p,
                      "] is ", output_splits[p]);
    }
    if (expects != input_splits[p]) {
      absl::StrAppend(&d, sends_me != output_splits[p] ? " and" : "",
                      " expects ", expects, " elements, input_splits[", p,
                      "] is ", input_splits[p]);
    }
    disagreements.push_back(std::move(d));
  }
  // Phase 2: the non-empty chunks of the agreeing pairs.
  const uint64_t data_slot = base + static_cast<uint8_t>(1);
  std::unique_ptr<gloo::transport::UnboundBuffer> in_ub, out_ub;
  if (input.nbytes() > 0) {
    in_ub = context.createUnboundBuffer(input.data, input.nbytes());
  }
  if (output.nbytes() > 0) {
    out_ub = context.createUnboundBuffer(output.data, output.nbytes());
  }
  int sends = 0, recvs = 0;
  for (int i = 1; i < size; ++i) {
    const int to = (rank + i) % size, from = (rank + size - i) % size;
    if (agree[to] && bytes_in(to) > 0) {
      in_ub->send(to, data_slot, in_off[to], bytes_in(to));
      ++sends;
    }
    if (agree[from] && bytes_out(from) > 0) {
      out_ub->recv(from, data_slot, out_off[from], bytes_out(from));
      ++recvs;
    }
  }
  if (sends > 0) {
    FSDPP_RETURN_IF_ERROR(wait(*in_ub, true, sends, "sending the chunks"));
  }
  if (recvs > 0) {
    FSDPP_RETURN_IF_ERROR(wait(*out_ub, false, recvs, "receiving the chunks"));
  }
  if (!disagreements.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split sizes disagree (nothing moved to or from the ranks named): ",
        absl::StrJoin(disagreements, "; ")));
  }
  return absl::OkStatus();
}

// Gloo's TCP pairs write with writev, which has no MSG_NOSIGNAL: writing
// into the socket of a peer that just died raises SIGPIPE, whose default
// action kills this process before the op can fail with an error naming the
// dead rank. So, as Python does at start-up, the default disposition becomes
// "ignore" (the write then fails with EPIPE and Gloo reports it). A handler
// the program installed itself is left alone.
void IgnoreSigpipeIfDefault() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  struct sigaction current;
  if (sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) {
    return;
  }
  struct sigaction ignore = {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGPIPE, &ignore, nullptr);
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::Create(
    Store* store, int rank, int size, std::string name, GlooOptions options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", name, "': rank ", rank, " is not in [0, ", size, ")"));
  }
  IgnoreSigpipeIfDefault();
  PrefixStore group_store(name, store);
  // Join first, with our own keys, so a missing rank is named precisely.
  FSDPP_RETURN_IF_ERROR(group_store.Set(absl::StrCat("joined/", rank), "1"));
  std::vector<std::string> joined;
  for (int r = 0; r < size; ++r) joined.push_back(absl::StrCat("joined/", r));
  absl::Status s = group_store.Wait(joined, options.timeout);
  if (!s.ok()) {
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      absl::StatusOr<bool> present = group_store.Check({joined[r]});
      if (present.ok() && !*present) missing.push_back(r);
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "group '", name, "' (rank ", rank, " of ", size, "): ranks [",
        absl::StrJoin(missing, ", "), "] did not join within ",
        absl::FormatDuration(options.timeout)));
  }
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<gloo::transport::Device> device,
                         DeviceFor(options.hostname));
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(ToMillis(options.timeout));
  PrefixStore mesh_store("gloo", &group_store);
  GlooStoreAdapter adapter(&mesh_store, options.timeout);
  try {
    context->connectFullMesh(adapter, device);
  } catch (const StoreError& e) {
    return Annotate(e.status,
                    absl::StrCat("group '", name, "' connecting rank ", rank));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "group '", name, "' connecting rank ", rank, ": ", e.what()));
  }
  // Every rank takes part, asking for shared memory or not, so all agree.
  absl::StatusOr<std::unique_ptr<SharedMemoryCollectives>> shm =
      SharedMemoryCollectives::Connect(&group_store, rank, size,
                                       options.shared_memory, options.timeout);
  if (!shm.ok()) {
    return Annotate(shm.status(),
                    absl::StrCat("group '", name, "' joining shared memory"));
  }
  return std::unique_ptr<GlooProcessGroup>(new GlooProcessGroup(
      store, rank, size, std::move(name), std::move(options),
      std::move(context), *std::move(shm)));
}

GlooProcessGroup::GlooProcessGroup(Store* store, int rank, int size,
                                   std::string name, GlooOptions options,
                                   std::shared_ptr<gloo::Context> context,
                                   std::unique_ptr<SharedMemoryCollectives> shm)
    : store_(store),
      group_store_(name, store),
      rank_(rank),
      size_(size),
      name_(std::move(name)),
      options_(std::move(options)),
      context_(std::move(context)),
      shm_(std::move(shm)),
      stream_(std::make_unique<CpuStream>(absl::StrCat("comm:", name_),
                                          options_.timeout)),
      heartbeat_(&group_store_, rank_, size_, name_,
                 options_.heartbeat_interval) {}

GlooProcessGroup::~GlooProcessGroup() {
  absl::Status s = stream_->Synchronize(options_.timeout + absl::Seconds(10));
  LOG_IF(WARNING, !s.ok()) << "group '" << name_ << "' closing: " << s;
  stream_.reset();
}

void GlooProcessGroup::SimulateCrash() {
  crashed_ = true;
  if (shm_ != nullptr) {
    shm_->Break(absl::AbortedError(
        absl::StrCat("group '", name_, "': this rank crashed")));
  }
  heartbeat_.Stop();
}

GlooProcessGroup::StreamScratch* GlooProcessGroup::ScratchFor(
    const CpuStream* stream) {
  std::lock_guard<std::mutex> lock(scratch_mu_);
  std::unique_ptr<StreamScratch>& area = scratch_[stream];
  if (area == nullptr) area = std::make_unique<StreamScratch>();
  return area.get();
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::Issue(
    const char* op, std::string detail, const CollectiveOptions& options,
    int sequential_waits, OpBody body) {
  const uint64_t seq = next_seq_++;
  return IssueOn(
      op, seq, /*collective=*/true,
      absl::StrCat(op, " #", seq, " on group '", name_, "' (rank ", rank_,
                   " of ", size_, detail.empty() ? "" : ", ", detail, ")"),
      options, sequential_waits, std::move(body));
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::IssueP2P(
    std::string detail, const CollectiveOptions& options, int sequential_waits,
    OpBody body) {
  uint64_t batch = 0;
  {
    std::lock_guard<std::mutex> lock(p2p_mu_);
    batch = p2p_batches_++;
  }
  return IssueOn("p2p", batch, /*collective=*/false,
                 absl::StrCat("p2p #", batch, " on group '", name_, "' (rank ",
                              rank_, " of ", size_, ": ", detail, ")"),
                 options, sequential_waits, std::move(body));
}

absl::StatusOr<CpuStream*> GlooProcessGroup::StreamFor(
    const char* op, const CollectiveOptions& options) {
  if (options.stream == nullptr) return stream_.get();
  CpuStream* stream = dynamic_cast<CpuStream*>(options.stream);
  if (stream == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, " on group '", name_, "': Gloo ops need a CpuStream, not ",
        options.stream->name()));
  }
  return stream;
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::IssueOn(
    const char* op, uint64_t seq, bool collective, std::string description,
    const CollectiveOptions& options, int sequential_waits, OpBody body) {
  FSDPP_ASSIGN_OR_RETURN(CpuStream * stream, StreamFor(op, options));
  const absl::Duration timeout = options.timeout > absl::ZeroDuration()
                                     ? options.timeout
                                     : options_.timeout;
  // How long the task can take: Gloo applies the timeout to each of its
  // blocking waits, plus the failure diagnosis (two reads of every peer's
  // heartbeat, three beats apart). A waiter runs the op itself only when
  // this fits inside its own deadline (CpuStream).
  const absl::Duration max_runtime =
      std::max(1, sequential_waits) * timeout + heartbeat_.MaxDiagnosisTime();
  if (options.after != nullptr) stream->WaitEvent(options.after);
  // The issuing thread's trace records the op where it runs (the stream).
  TraceRecorder* trace = CurrentTrace();
  std::shared_ptr<Event> event = stream->EnqueueAndRecord(
      [this, seq, collective, timeout, description, trace, op,
       track = stream->name(), scratch = ScratchFor(stream),
       body = std::move(body)]() {
        if (crashed_) {
          return absl::AbortedError(
              absl::StrCat(description, ": this rank crashed"));
        }
        TraceSpan span(op, "comm", trace, track.c_str());
        if (trace != nullptr) span.set_detail(description);
        if (collective) heartbeat_.MarkStarted(seq);
        absl::Status status;
        try {
          status =
              body(static_cast<uint32_t>(seq), ToMillis(timeout), *scratch);
        } catch (const std::exception& e) {
          status = absl::UnavailableError(e.what());
        }
        if (status.ok()) return status;
        // A caller's error the op found while running (all_to_all_v's
        // split sizes disagree between ranks): its transfers have ended and
        // the peers answered, so there is nobody to diagnose.
        if (absl::IsInvalidArgument(status)) {
          return absl::InvalidArgumentError(
              absl::StrCat(description, ": ", status.message()));
        }
        return absl::Status(
            absl::IsDeadlineExceeded(status)
                ? absl::StatusCode::kDeadlineExceeded
                : absl::StatusCode::kUnavailable,
            absl::StrCat(description, " failed (timeout ",
                         absl::FormatDuration(timeout), "): ", status.message(),
                         "; ",
                         // Point-to-point: every live peer has "reached" 0,
                         // so only the dead ones are named.
                         heartbeat_.DiagnosePeers(collective ? seq : 0)));
      },
      max_runtime, /*wake_worker=*/options.async_op);
  if (!options.async_op) {
    // Runs the op here unless the stream is busy (then waits for the worker);
    // bounded by the op's own bound plus one timeout for what is queued
    // before it. The Work carries the outcome.
    event->Wait(max_runtime + timeout).IgnoreError();
  }
  return std::make_shared<Work>(std::move(description), std::move(event));
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::AllGather(
    const Buffer& input, const Buffer& output,
    const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateAllGather(*this, input, output));
  const size_t bytes = input.nbytes();
  const bool in_place =
      input.data == static_cast<char*>(output.data) + rank_ * bytes;
  if (shm_ != nullptr) {
    // The ticket once the op cannot fail to queue: every ticket must run.
    FSDPP_RETURN_IF_ERROR(StreamFor("all_gather", options).status());
    return Issue(
        "all_gather", input.ToString(), options, 1,
        [this, input, output, bytes, ticket = shm_->Ticket()](
            uint32_t, std::chrono::milliseconds timeout, StreamScratch&) {
          return shm_->AllGather(ticket, input.data, output.data, bytes,
                                 absl::FromChrono(timeout));
        });
  }
  return Issue(
      "all_gather", input.ToString(), options, 2 * (size_ - 1),
      [this, input, output, bytes, in_place](
          uint32_t tag, std::chrono::milliseconds timeout, StreamScratch&) {
        if (bytes == 0) return absl::OkStatus();
        if (size_ == 1) {
          if (!in_place) std::memcpy(output.data, input.data, bytes);
          return absl::OkStatus();
        }
        gloo::AllgatherOptions o(context_);
        if (!in_place) o.setInput(static_cast<uint8_t*>(input.data), bytes);
        o.setOutput(static_cast<uint8_t*>(output.data), bytes * size_);
        o.setTag(tag);
        o.setTimeout(timeout);
        gloo::allgather(o);
        return absl::OkStatus();
      });
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::AllGatherRuns(
    const Buffer& output, const std::vector<std::vector<BufferRun>>& runs,
    const CollectiveOptions& options) {
  if (shm_ == nullptr) {
    return ProcessGroup::AllGatherRuns(output, runs, options);
  }
  FSDPP_RETURN_IF_ERROR(ValidateAllGatherRuns(*this, output, runs));
  const size_t esize = DTypeSize(output.dtype);
  std::vector<std::vector<SharedMemoryCollectives::ByteRun>> bytes(size_);
  for (int r = 0; r < size_; ++r) {
    for (const BufferRun& run : runs[r]) {
      bytes[r].push_back({static_cast<size_t>(run.offset) * esize,
                          static_cast<size_t>(run.count) * esize});
    }
  }
  // The ticket once the op cannot fail to queue: every ticket must run.
  FSDPP_RETURN_IF_ERROR(StreamFor("all_gather", options).status());
  return Issue(
      "all_gather", output.ToString(), options, 1,
      [this, output, bytes = std::move(bytes), ticket = shm_->Ticket()](
          uint32_t, std::chrono::milliseconds timeout, StreamScratch&) {
        return shm_->AllGatherRuns(ticket, output.data, bytes,
                                   absl::FromChrono(timeout));
      });
}

namespace {

// Shared memory's combine for a reduce-scatter into `result` (this rank's
// chunk, as Acc): the ranks' pieces added in the TCP ring's order (rank + 1,
// rank + 2, ..., rank), so both transports give the same bits.
template <typename Acc>
SharedMemoryCollectives::Combine RingOrderCombine(Acc* result, DType dtype,
                                                  ReduceOp op, int rank,
                                                  int size) {
  return [=](int64_t first, int64_t len, const void* const* sources) {
    Acc* out = result + first;
    LoadAs<Acc>(sources[(rank + 1) % size], dtype, 0, len, out);
    for (int i = 2; i <= size; ++i) {
      CombineFrom<Acc>(out, out, sources[(rank + i) % size], dtype, 0, len, op);
    }
  };
}

// A reduce-scatter's result, n input elements of `dtype` in all, into
// `output` (this rank's chunk): reduce(result) fills it as Acc (int32,
// int64, u8, or f32 for float dtypes, staged when the output is bf16 or
// f16), then the average is taken and the staging cast out.
template <typename Reduce>
absl::Status ReduceIntoOutput(DType dtype, int64_t n, const Buffer& output,
                              ReduceOp op, int size, Reduce&& reduce) {
  switch (dtype) {
    case DType::kI32:
      return reduce(static_cast<int32_t*>(output.data));
    case DType::kI64:
      return reduce(static_cast<int64_t*>(output.data));
    case DType::kU8:
      return reduce(static_cast<uint8_t*>(output.data));
    default: {
      const int64_t count = output.count;
      float* result = static_cast<float*>(output.data);
      Scratch staged;  // f32 result for bf16 / f16 outputs.
      if (output.dtype != DType::kF32) {
        FSDPP_ASSIGN_OR_RETURN(
            staged, Scratch::Allocate(GlooReduceScatterScratch(
                                          n, dtype, output.dtype, count, size)
                                          .transient));
        result = staged.as<float>();
      }
      FSDPP_RETURN_IF_ERROR(reduce(result));
      if (op == ReduceOp::kAvg) {
        const float inv = 1.0f / static_cast<float>(size);
        for (int64_t i = 0; i < count; ++i) result[i] *= inv;
      }
      if (output.dtype != DType::kF32) FromF32(result, count, output);
      return absl::OkStatus();
    }
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::ReduceScatter(
    const Buffer& input, const Buffer& output, ReduceOp op,
    const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateReduceScatter(*this, input, output, op));
  uint64_t ticket = 0;
  if (shm_ != nullptr) {
    // The ticket once the op cannot fail to queue: every ticket must run.
    FSDPP_RETURN_IF_ERROR(StreamFor("reduce_scatter", options).status());
    ticket = shm_->Ticket();
  }
  return Issue(
      "reduce_scatter", absl::StrCat(input.ToString(), ", ", ReduceOpName(op)),
      options, /*sequential_waits=*/1,
      [this, input, output, op, ticket](
          uint32_t tag, std::chrono::milliseconds timeout,
          StreamScratch& scratch) -> absl::Status {
        const int64_t n = input.count;
        return ReduceIntoOutput(
            input.dtype, n, output, op, size_,
            [&](auto* result) -> absl::Status {
              using Acc = std::remove_pointer_t<decltype(result)>;
              if (shm_ == nullptr) {
                return RingReduceScatter<Acc>(*context_, input.data,
                                              input.dtype, n, op, tag, timeout,
                                              scratch, result);
              }
              return shm_->ReduceScatter(
                  ticket, input.data, DTypeSize(input.dtype), n,
                  absl::FromChrono(timeout),
                  RingOrderCombine<Acc>(result, input.dtype, op, rank_, size_));
            });
      });
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::ReduceScatterSpans(
    DType dtype, const std::vector<std::vector<BufferSpan>>& spans,
    const Buffer& output, ReduceOp op, const CollectiveOptions& options) {
  if (shm_ == nullptr) {
    return ProcessGroup::ReduceScatterSpans(dtype, spans, output, op, options);
  }
  FSDPP_RETURN_IF_ERROR(
      ValidateReduceScatterSpans(*this, dtype, spans, output, op));
  const size_t esize = DTypeSize(dtype);
  std::vector<std::vector<SharedMemoryCollectives::ByteSpan>> bytes(size_);
  for (int q = 0; q < size_; ++q) {
    for (const BufferSpan& span : spans[q]) {
      bytes[q].push_back({static_cast<const char*>(span.data),
                          static_cast<size_t>(span.count) * esize});
    }
  }
  const int64_t n = ElementsIn(spans);
  // The ticket once the op cannot fail to queue: every ticket must run.
  FSDPP_RETURN_IF_ERROR(StreamFor("reduce_scatter", options).status());
  return Issue(
      "reduce_scatter",
      absl::StrCat(n, " x ", DTypeName(dtype), " in spans, ", ReduceOpName(op)),
      options, /*sequential_waits=*/1,
      [this, dtype, bytes = std::move(bytes), n, output, op,
       ticket = shm_->Ticket()](uint32_t, std::chrono::milliseconds timeout,
                                StreamScratch&) -> absl::Status {
        return ReduceIntoOutput(
            dtype, n, output, op, size_, [&](auto* result) -> absl::Status {
              using Acc = std::remove_pointer_t<decltype(result)>;
              return shm_->ReduceScatterSpans(
                  ticket, DTypeSize(dtype), bytes, absl::FromChrono(timeout),
                  RingOrderCombine<Acc>(result, dtype, op, rank_, size_));
            });
      });
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::AllReduce(
    const Buffer& buffer, ReduceOp op, const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateAllReduce(*this, buffer, op));
  return Issue(
      "all_reduce", absl::StrCat(buffer.ToString(), ", ", ReduceOpName(op)),
      options, 2 * (size_ - 1),
      [this, buffer, op](uint32_t tag, std::chrono::milliseconds timeout,
                         StreamScratch&) -> absl::Status {
        const int64_t n = buffer.count;
        if (n == 0) return absl::OkStatus();
        auto reduce = [&](auto* data) {
          using T = std::remove_pointer_t<decltype(data)>;
          if (size_ == 1) return;
          gloo::AllreduceOptions o(context_);
          o.setOutput(data, n);
          o.setReduceFunction(ReduceFunction<T>(op));
          o.setTag(tag);
          o.setTimeout(timeout);
          gloo::allreduce(o);
        };
        switch (buffer.dtype) {
          case DType::kI32:
            reduce(static_cast<int32_t*>(buffer.data));
            return absl::OkStatus();
          case DType::kI64:
            reduce(static_cast<int64_t*>(buffer.data));
            return absl::OkStatus();
          case DType::kU8:
            reduce(static_cast<uint8_t*>(buffer.data));
            return absl::OkStatus();
          case DType::kF32: {
            float* data = static_cast<float*>(buffer.data);
            reduce(data);
            if (op == ReduceOp::kAvg) {
              const float inv = 1.0f / static_cast<float>(size_);
              for (int64_t i = 0; i < n; ++i) data[i] *= inv;
            }
            return absl::OkStatus();
          }
          default: {  // bf16 / f16: accumulate in f32.
            FSDPP_ASSIGN_OR_RETURN(
                Scratch work,
                Scratch::Allocate(
                    GlooAllReduceScratch(n, buffer.dtype, size_).transient));
            float* data = work.as<float>();
            ToF32(buffer, data, 0, n);
            reduce(data);
            if (op == ReduceOp::kAvg) {
              const float inv = 1.0f / static_cast<float>(size_);
              for (int64_t i = 0; i < n; ++i) data[i] *= inv;
            }
            FromF32(data, n, buffer);
            return absl::OkStatus();
          }
        }
      });
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::Broadcast(
    const Buffer& buffer, int root, const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateBroadcast(*this, buffer, root));
  return Issue(
      "broadcast", absl::StrCat(buffer.ToString(), ", root ", root), options,
      2 * (size_ - 1),
      [this, buffer, root](uint32_t tag, std::chrono::milliseconds timeout,
                           StreamScratch&) {
        if (buffer.count == 0 || size_ == 1) return absl::OkStatus();
        gloo::BroadcastOptions o(context_);
        o.setOutput(static_cast<uint8_t*>(buffer.data), buffer.nbytes());
        o.setRoot(root);
        o.setTag(tag);
        o.setTimeout(timeout);
        gloo::broadcast(o);
        return absl::OkStatus();
      });
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::AllToAll(
    const Buffer& input, const Buffer& output,
    const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateAllToAll(*this, input, output));
  return Issue(
      "all_to_all", input.ToString(), options, 2 * (size_ - 1),
      [this, input, output](uint32_t tag, std::chrono::milliseconds timeout,
                            StreamScratch&) -> absl::Status {
        const size_t bytes = input.nbytes();
        if (bytes == 0) return absl::OkStatus();
        if (size_ == 1) {
          if (input.data != output.data)
            std::memcpy(output.data, input.data, bytes);
          return absl::OkStatus();
        }
        Scratch staged;
        uint8_t* in = static_cast<uint8_t*>(input.data);
        if (input.data == output.data) {  // Gloo needs distinct buffers.
          FSDPP_ASSIGN_OR_RETURN(
              staged, Scratch::Allocate(
                          GlooAllToAllScratch(bytes, true, size_).transient));
          std::memcpy(staged.as<void>(), input.data, bytes);
          in = staged.as<uint8_t>();
        }
        gloo::AlltoallOptions o(context_);
        o.setInput(in, bytes);
        o.setOutput(static_cast<uint8_t*>(output.data), bytes);
        o.setTag(tag);
        o.setTimeout(timeout);
        gloo::alltoall(o);
        return absl::OkStatus();
      });
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::AllToAllV(
    const Buffer& input, const std::vector<int64_t>& input_splits,
    const Buffer& output, const std::vector<int64_t>& output_splits,
    const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(
      ValidateAllToAllV(*this, input, input_splits, output, output_splits));
  // One deadline covers both phases.
  return Issue(
      "all_to_all_v", AllToAllVDetail(input.dtype, input_splits, output_splits),
      options, /*sequential_waits=*/1,
      [this, input, input_splits, output, output_splits](
          uint32_t tag, std::chrono::milliseconds timeout, StreamScratch&) {
        return AllToAllVExchange(*context_, input, input_splits, output,
                                 output_splits, tag, timeout);
      });
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::Barrier(
    const CollectiveOptions& options) {
  return Issue(
      "barrier", "", options, 2 * (size_ - 1),
      [this](uint32_t tag, std::chrono::milliseconds timeout, StreamScratch&) {
        if (size_ == 1) return absl::OkStatus();
        gloo::BarrierOptions o(context_);
        o.setTag(tag);
        o.setTimeout(timeout);
        gloo::barrier(o);
        return absl::OkStatus();
      });
}

absl::StatusOr<std::shared_ptr<Work>> GlooProcessGroup::BatchP2P(
    const std::vector<P2POp>& ops, const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateP2P(*this, ops));
  // Slots are assigned here, in program order: the n-th transfer between a
  // pair of ranks in each direction gets slot n on both sides.
  std::vector<uint64_t> slots;
  {
    std::lock_guard<std::mutex> lock(p2p_mu_);
    for (const P2POp& op : ops) {
      uint64_t& n = op.kind == P2POp::Kind::kSend
                        ? sends_to_[{op.peer, op.tag}]
                        : recvs_from_[{op.peer, op.tag}];
      // The prefix in the top 8 bits (as gloo::Slot lays collectives out),
      // then the tag (20 bits) above the transfer's number (36 bits).
      slots.push_back((uint64_t{kP2PSlotPrefix} << 56) |
                      (static_cast<uint64_t>(op.tag) << 36) |
                      (n++ & ((uint64_t{1} << 36) - 1)));
    }
  }
  return IssueP2P(
      P2PDetail(ops), options, static_cast<int>(ops.size()),
      [this, ops, slots](uint32_t, std::chrono::milliseconds timeout,
                         StreamScratch&) -> absl::Status {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        auto left = [&deadline] {
          return std::max(std::chrono::milliseconds(1),
                          std::chrono::duration_cast<std::chrono::milliseconds>(
                              deadline - std::chrono::steady_clock::now()));
        };
        std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> ub(
            ops.size());
        for (size_t i = 0; i < ops.size(); ++i) {
          const size_t bytes = ops[i].buffer.nbytes();
          if (bytes == 0) continue;
          ub[i] = context_->createUnboundBuffer(ops[i].buffer.data, bytes);
          if (ops[i].kind == P2POp::Kind::kSend) {
            ub[i]->send(ops[i].peer, slots[i]);
          } else {
            ub[i]->recv(ops[i].peer, slots[i]);
          }
        }
        for (size_t i = 0; i < ops.size(); ++i) {
          if (ub[i] == nullptr) continue;
          const bool send = ops[i].kind == P2POp::Kind::kSend;
          const std::string what =
              absl::StrCat(send ? "send to" : "receive from", " rank ",
                           ops[i].peer, " did not complete");
          try {
            const bool ok = send ? ub[i]->waitSend(nullptr, left())
                                 : ub[i]->waitRecv(nullptr, left());
            if (!ok) return absl::DeadlineExceededError(what);
          } catch (const std::exception& e) {
            return absl::DeadlineExceededError(
                absl::StrCat(what, ": ", e.what()));
          }
        }
        return absl::OkStatus();
      });
}

ProcessGroupFactory GlooGroupFactory(Store* store, GlooOptions options) {
  return [store, options](
             const std::string& name, int rank,
             int size) -> absl::StatusOr<std::unique_ptr<ProcessGroup>> {
    FSDPP_ASSIGN_OR_RETURN(
        std::unique_ptr<GlooProcessGroup> group,
        GlooProcessGroup::Create(store, rank, size, name, options));
    return std::unique_ptr<ProcessGroup>(std::move(group));
  };
}

GlooScratch GlooReduceScatterScratch(int64_t n, DType dtype, DType out_dtype,
                                     int64_t out_count, int size,
                                     bool shared_memory) {
  GlooScratch s;
  const bool floating = IsFloatingPoint(dtype);
  // Integers accumulate in their own type, floats in f32.
  if (size > 1 && n > 0 && !shared_memory) {
    s.held = 3 * static_cast<int64_t>(RingChunkBytes(
                     n, size, floating ? sizeof(float) : DTypeSize(dtype)));
  }
  if (floating && out_dtype != DType::kF32) {
    s.transient = std::max<int64_t>(1, out_count) * sizeof(float);
  }
  return s;
}

GlooScratch GlooAllReduceScratch(int64_t n, DType dtype, int) {
  GlooScratch s;
  if (n > 0 && (dtype == DType::kBF16 || dtype == DType::kF16)) {
    s.transient = n * static_cast<int64_t>(sizeof(float));
  }
  return s;
}

GlooScratch GlooAllToAllScratch(int64_t bytes, bool in_place, int size) {
  GlooScratch s;
  if (bytes > 0 && size > 1 && in_place) s.transient = bytes;
  return s;
}

}  // namespace fsdpp
