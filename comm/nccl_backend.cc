// NCCL process group; see nccl_backend.h.
//
// Locking: comm_mu_ serializes every NCCL call on the communicator (issuing,
// the watchdog's async-error polls, abort, finalize); mu_ guards the op lists
// and the broken state; each op record has its own mutex. Order: comm_mu_,
// then mu_ or a record's mutex; mu_ and record mutexes are never nested.
#include "comm/nccl_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "comm/nccl_kernels.h"
#include "core/allocator.h"
#include "core/device_wait.h"
#include "core/logging.h"
#include "core/status.h"

namespace fsdpp {
namespace {

// How often the watchdog polls outstanding ops.
constexpr absl::Duration kWatchdogTick = absl::Milliseconds(5);
// How long teardown waits for the kernels of failed ops to leave.
constexpr absl::Duration kDrainTimeout = absl::Seconds(10);

// Makes `device` current for the scope and restores the previous device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    status_ = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

// Exponential backoff sleep for polling loops: 2us doubling up to 1ms.
class Backoff {
 public:
  void Sleep() {
    absl::SleepFor(delay_);
    delay_ = std::min(delay_ * 2, absl::Microseconds(50));
  }

 private:
  absl::Duration delay_ = absl::Microseconds(2);
};

// cudaEventQuery that does not leave cudaErrorNotReady behind as the
// thread's last error (a later launch check would report it).
cudaError_t QueryEvent(const CudaEvent& event) {
  cudaError_t e = cudaEventQuery(event.get());
  if (e == cudaErrorNotReady) cudaGetLastError();
  return e;
}

// "unhandled system error (<NCCL's last error message>)".
std::string NcclErrorText(ncclComm_t comm, ncclResult_t result) {
  std::string text = ncclGetErrorString(result);
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  if (last != nullptr && *last != '\0') absl::StrAppend(&text, " (", last, ")");
  return text;
}

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kU8:
      return ncclUint8;
  }
  return ncclUint8;
}

// NCCL's op for `op` over `ranks` ranks. On one rank every reduction is the
// identity, and asks for ncclSum: NCCL before 2.29.7 runs a one-rank ncclAvg
// through a kernel that leaves the last elements of some counts unwritten
// (NVIDIA/nccl#1950; seen here as a stale tail of FSDP's reduce-scatter
// output on one GPU), while a one-rank sum is a plain copy.
ncclRedOp_t NcclRedOp(ReduceOp op, int ranks) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ranks == 1 ? ncclSum : ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

// bf16 / f16: reduced in an f32 scratch.
bool ReducesInF32(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kF16;
}

// Device memory from the caching allocator, tagged as comm buffers; freed
// on destruction unless leaked.
class DeviceScratch {
 public:
  DeviceScratch(Allocator* allocator, void* ptr, size_t bytes)
      : allocator_(allocator), ptr_(ptr), bytes_(bytes) {}
  DeviceScratch(DeviceScratch&& o) noexcept
      : allocator_(o.allocator_), ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
  }
  DeviceScratch& operator=(DeviceScratch&& o) noexcept {
    std::swap(allocator_, o.allocator_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceScratch() {
    if (ptr_ != nullptr) {
      allocator_->Deallocate(ptr_, bytes_, MemoryTag::kCommBuffers);
    }
  }
  // Gives the memory up without freeing it (kernels may still use it).
  void Leak() { ptr_ = nullptr; }

 private:
  Allocator* allocator_;
  void* ptr_;
  size_t bytes_;
};

}  // namespace

// One issued op: its identity, its CUDA event, the scratch it holds and, once
// resolved, its Status. Shared by the group's lists and the Work's event.
struct NcclOpRecord {
  NcclOpRecord(uint64_t seq, std::string description, absl::Duration timeout)
      : seq(seq),
        description(std::move(description)),
        timeout(timeout),
        deadline(absl::Now() + timeout) {}

  // True once resolved; resolves the op OK (and frees its scratch) when its
  // CUDA event has completed.
  bool Poll() {
    std::vector<DeviceScratch> release;  // Freed after the lock is dropped.
    std::lock_guard<std::mutex> lock(mu);
    if (resolved) return true;
    if (issuing || done == nullptr || QueryEvent(*done) != cudaSuccess) {
      return false;
    }
    resolved = true;
    release.swap(scratch);
    return true;
  }

  // Resolves the op with `status` unless it has already resolved or its
  // kernels have in fact completed. The scratch stays until they are gone.
  void Fail(const absl::Status& status) {
    if (Poll()) return;
    std::lock_guard<std::mutex> lock(mu);
    if (resolved) return;
    resolved = true;
    result = status;
  }

  // The enqueueing is over; `event` (null if recording failed) marks the end
  // of whatever reached the stream.
  void Enqueued(std::shared_ptr<CudaEvent> event) {
    std::lock_guard<std::mutex> lock(mu);
    issuing = false;
    done = std::move(event);
  }

  // CUDA error of the op's event (cudaSuccess while running or done).
  cudaError_t EventError() {
    std::lock_guard<std::mutex> lock(mu);
    if (issuing || done == nullptr) return cudaSuccess;
    cudaError_t e = QueryEvent(*done);
    return e == cudaErrorNotReady ? cudaSuccess : e;
  }

  // Frees the scratch once the kernels are gone (waiting up to `wait`), or
  // leaks it when they never leave; returns false while they may still run
  // and `leak` is false.
  bool ReleaseScratch(absl::Duration wait, bool leak) {
    std::shared_ptr<CudaEvent> event;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (scratch.empty()) return true;
      event = done;
    }
    bool gone = false;
    if (event != nullptr) {
      const absl::Time until = absl::Now() + wait;
      Backoff backoff;
      cudaError_t e;
      while ((e = QueryEvent(*event)) == cudaErrorNotReady &&
             absl::Now() < until) {
        backoff.Sleep();
      }
      gone = e != cudaErrorNotReady;
    }
    if (!gone && !leak && event != nullptr) return false;
    std::vector<DeviceScratch> release;
    {
      std::lock_guard<std::mutex> lock(mu);
      release.swap(scratch);
    }
    if (!gone) {
      LOG(ERROR) << description
                 << ": leaking its scratch memory, its kernels may still run";
      for (DeviceScratch& s : release) s.Leak();
    }
    return true;
  }

  bool HoldsScratch() {
    std::lock_guard<std::mutex> lock(mu);
    return !scratch.empty();
  }
  bool Issuing() {
    std::lock_guard<std::mutex> lock(mu);
    return issuing;
  }
  absl::Status Result() {
    std::lock_guard<std::mutex> lock(mu);
    return result;
  }
  std::shared_ptr<CudaEvent> Done() {
    std::lock_guard<std::mutex> lock(mu);
    return done;
  }

  const uint64_t seq;
  const std::string description;
  const absl::Duration timeout;
  const absl::Time deadline;

  std::mutex mu;  // Guards the fields below.
  bool issuing = true;
  std::shared_ptr<CudaEvent> done;
  std::vector<DeviceScratch> scratch;
  bool resolved = false;
  absl::Status result;
};

bool NcclWorkEvent::IsCompleted() const { return op_->Poll(); }

absl::Status NcclWorkEvent::Wait(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  Backoff backoff;
  // A host sync only when the host does wait (not for a completed op).
  if (!op_->Poll()) CountHostSync();
  while (!op_->Poll()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("event ", name(), " did not complete within ",
                       absl::FormatDuration(timeout)));
    }
    backoff.Sleep();
  }
  return op_->Result();
}

std::string NcclWorkEvent::name() const { return op_->description; }

std::shared_ptr<CudaEvent> NcclWorkEvent::cuda_event() const {
  return op_->Done();
}

void* NcclWorkEvent::cuda_event_handle() const {
  std::shared_ptr<CudaEvent> done = op_->Done();
  return done == nullptr ? nullptr : done->get();
}

struct NcclProcessGroup::OpContext {
  cudaStream_t stream;
  ncclComm_t comm;
  NcclOpRecord* op;
  const std::atomic<bool>* abort_requested;
  Allocator* allocator;

  // OK if `result` is ncclSuccess, or ncclInProgress that turns into success
  // (a non-blocking communicator connecting to peers) before the op's
  // deadline; the NCCL error otherwise.
  absl::Status Check(ncclResult_t result, const char* what) {
    Backoff backoff;
    while (result == ncclInProgress) {
      if (abort_requested->load()) {
        return absl::AbortedError(
            absl::StrCat(what, ": the group is being aborted"));
      }
      if (absl::Now() >= op->deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(what,
                         " still in progress (NCCL waiting for peers) at the "
                         "deadline"));
      }
      backoff.Sleep();
      ncclResult_t r = ncclCommGetAsyncError(comm, &result);
      if (r != ncclSuccess) result = r;
    }
    if (result != ncclSuccess) {
      return absl::UnavailableError(
          absl::StrCat(what, ": ", NcclErrorText(comm, result)));
    }
    return absl::OkStatus();
  }

  // `bytes` (> 0) of device memory owned by the op until it completes.
  absl::StatusOr<void*> Scratch(size_t bytes) {
    FSDPP_ASSIGN_OR_RETURN(void* ptr,
                           allocator->Allocate(bytes, MemoryTag::kCommBuffers));
    std::lock_guard<std::mutex> lock(op->mu);
    op->scratch.emplace_back(allocator, ptr, bytes);
    return ptr;
  }
};

absl::StatusOr<std::unique_ptr<NcclProcessGroup>> NcclProcessGroup::Create(
    Store* store, int rank, int size, std::string name, int cuda_device,
    NcclOptions options) {
  const std::string who =
      absl::StrCat("group '", name, "' (rank ", rank, " of ", size, ")");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", name, "': rank ", rank, " is not in [0, ", size, ")"));
  }
  const int devices = RegisterCudaAllocators();
  if (cuda_device < 0 || cuda_device >= devices) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": cuda:", cuda_device, " is not a visible GPU (",
                     devices, " visible)"));
  }
  Allocator* allocator = GetAllocator(Device::Cuda(cuda_device));
  if (allocator == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": no allocator registered for cuda:", cuda_device));
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  PrefixStore group_store(name, store);
  DeviceGuard guard(cuda_device);
  FSDPP_RETURN_IF_ERROR(guard.status());

  // Rank 0 makes the NCCL id and publishes it before joining, so it is there
  // once everyone has joined.
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      return absl::UnavailableError(
          absl::StrCat(who, ": ncclGetUniqueId: ", NcclErrorText(nullptr, r)));
    }
    FSDPP_RETURN_IF_ERROR(group_store.Set(
        "nccl_id", absl::string_view(id.internal, sizeof(id.internal))));
  }
  // Join first, with our own keys, so a missing rank is named precisely.
  FSDPP_RETURN_IF_ERROR(group_store.Set(absl::StrCat("joined/", rank), "1"));
  std::vector<std::string> joined;
  for (int r = 0; r < size; ++r) joined.push_back(absl::StrCat("joined/", r));
  if (!group_store.Wait(joined, options.timeout).ok()) {
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      absl::StatusOr<bool> present = group_store.Check({joined[r]});
      if (present.ok() && !*present) missing.push_back(r);
    }
    return absl::DeadlineExceededError(absl::StrCat(
        who, ": ranks [", absl::StrJoin(missing, ", "),
        "] did not join within ", absl::FormatDuration(options.timeout)));
  }
  if (rank != 0) {
    absl::StatusOr<std::string> value = group_store.Get(
        "nccl_id", std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!value.ok()) {
      return absl::DeadlineExceededError(absl::StrCat(
          who, ": rank 0 did not publish the NCCL id under key '", name,
          "/nccl_id' within ", absl::FormatDuration(options.timeout), ": ",
          value.status().message()));
    }
    if (value->size() != sizeof(id.internal)) {
      return absl::DataLossError(
          absl::StrCat(who, ": key '", name, "/nccl_id' holds ", value->size(),
                       " bytes, an NCCL id has ", sizeof(id.internal)));
    }
    std::copy(value->begin(), value->end(), id.internal);
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t result = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  Backoff backoff;
  while (result == ncclInProgress && absl::Now() < deadline) {
    backoff.Sleep();
    ncclResult_t r = ncclCommGetAsyncError(comm, &result);
    if (r != ncclSuccess) result = r;
  }
  if (result != ncclSuccess) {
    std::string error = NcclErrorText(comm, result);
    if (comm != nullptr) ncclCommAbort(comm);
    if (result == ncclInProgress) {
      return absl::DeadlineExceededError(absl::StrCat(
          who, ": NCCL communicator init on cuda:", cuda_device,
          " did not finish within ", absl::FormatDuration(options.timeout),
          "; communicator aborted"));
    }
    return absl::UnavailableError(absl::StrCat(
        who, ": ncclCommInitRankConfig on cuda:", cuda_device, ": ", error));
  }
  absl::StatusOr<std::unique_ptr<CudaStream>> stream = CudaStream::Create(
      cuda_device, absl::StrCat("comm:", name), options.timeout);
  if (!stream.ok()) {
    ncclCommAbort(comm);
    return Annotate(stream.status(), who);
  }
  return std::unique_ptr<NcclProcessGroup>(new NcclProcessGroup(
      store, rank, size, std::move(name), cuda_device, std::move(options),
      allocator, comm, *std::move(stream)));
}

NcclProcessGroup::NcclProcessGroup(Store* store, int rank, int size,
                                   std::string name, int cuda_device,
                                   NcclOptions options, Allocator* allocator,
                                   ncclComm* comm,
                                   std::unique_ptr<CudaStream> stream)
    : group_store_(name, store),
      rank_(rank),
      size_(size),
      name_(std::move(name)),
      cuda_device_(cuda_device),
      options_(std::move(options)),
      allocator_(allocator),
      stream_(std::move(stream)),
      heartbeat_(&group_store_, rank_, size_, name_,
                 options_.heartbeat_interval),
      comm_(comm) {
  watchdog_ = std::thread([this] { WatchdogLoop(); });
}

NcclProcessGroup::~NcclProcessGroup() {
  {
    // The watchdog completes or fails every outstanding op by its deadline.
    std::unique_lock<std::mutex> lock(mu_);
    absl::Time until = absl::Now() + absl::Seconds(10);
    for (const auto& op : outstanding_) {
      until = std::max(until, op->deadline + absl::Seconds(10));
    }
    while (!outstanding_.empty() && absl::Now() < until) {
      cv_.wait_for(lock, std::chrono::milliseconds(10));
    }
    stop_watchdog_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
  {
    std::lock_guard<std::mutex> comm_lock(comm_mu_);
    if (comm_ != nullptr) {
      bool pending;
      {
        std::lock_guard<std::mutex> lock(mu_);
        pending = !outstanding_.empty();
      }
      if (pending) {
        BreakLocked(absl::DeadlineExceededError(
            absl::StrCat("group '", name_, "' (rank ", rank_, " of ", size_,
                         ") destroyed with ops still running")));
      } else {
        DeviceGuard guard(cuda_device_);
        const absl::Time deadline = absl::Now() + options_.timeout;
        ncclResult_t r = ncclCommFinalize(comm_);
        Backoff backoff;
        while (r == ncclInProgress && absl::Now() < deadline) {
          backoff.Sleep();
          ncclResult_t q = ncclCommGetAsyncError(comm_, &r);
          if (q != ncclSuccess) r = q;
        }
        if (r == ncclSuccess) {
          r = ncclCommDestroy(comm_);
          LOG_IF(WARNING, r != ncclSuccess)
              << "group '" << name_
              << "' ncclCommDestroy: " << ncclGetErrorString(r);
        } else {
          LOG(WARNING) << "group '" << name_
                       << "' ncclCommFinalize: " << NcclErrorText(comm_, r)
                       << "; aborting";
          ncclCommAbort(comm_);
        }
        comm_ = nullptr;
      }
    }
  }
  // Failed ops' kernels leave after the abort; their scratch goes with them.
  std::vector<std::shared_ptr<NcclOpRecord>> drain;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drain.swap(draining_);
    drain.insert(drain.end(), outstanding_.begin(), outstanding_.end());
  }
  for (const auto& op : drain) op->ReleaseScratch(kDrainTimeout, true);
}

absl::Status NcclProcessGroup::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

absl::Status NcclProcessGroup::OrderAfter(CudaStream* stream,
                                          const std::shared_ptr<Event>& after) {
  if (after != nullptr) {
    stream->WaitEvent(after);
  } else {
    // "After the issuing call" on a GPU includes the device work the host
    // has issued to the legacy default stream (tensor ops).
    FSDPP_ASSIGN_OR_RETURN(
        std::shared_ptr<CudaEvent> legacy,
        CudaEvent::RecordOn(cudaStreamLegacy, cuda_device_, "legacy"));
    stream->WaitEvent(std::move(legacy));
  }
  return stream->status();
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::Issue(
    const char* op, std::string detail, const CollectiveOptions& options,
    OpBody body, bool collective) {
  FSDPP_ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      IssueAsync(op, std::move(detail), options, std::move(body), collective));
  if (!options.async_op) {
    const absl::Duration timeout = options.timeout > absl::ZeroDuration()
                                       ? options.timeout
                                       : options_.timeout;
    work->Wait(timeout).IgnoreError();  // The Work keeps the outcome.
  }
  return work;
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::IssueAsync(
    const char* op, std::string detail, const CollectiveOptions& options,
    OpBody body, bool collective) {
  CudaStream* stream = stream_.get();
  if (options.stream != nullptr) {
    stream = dynamic_cast<CudaStream*>(options.stream);
    if (stream == nullptr || stream->device() != device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, " on group '", name_, "' (rank ", rank_, " of ", size_,
          "): NCCL ops need a CudaStream on ", device().ToString(), ", not ",
          options.stream->name(), " on ", options.stream->device().ToString()));
    }
  }
  const absl::Duration timeout = options.timeout > absl::ZeroDuration()
                                     ? options.timeout
                                     : options_.timeout;
  std::lock_guard<std::mutex> comm_lock(comm_mu_);
  // Point-to-point ops are numbered apart and diagnosed against op 0 (every
  // live peer has reached it, so only dead ones are named).
  const uint64_t number = collective ? next_seq_++ : p2p_batches_++;
  const uint64_t seq = collective ? number : 0;
  auto record = std::make_shared<NcclOpRecord>(
      seq,
      absl::StrCat(op, " #", number, " on group '", name_, "' (rank ", rank_,
                   " of ", size_, detail.empty() ? "" : ", ", detail, ")"),
      timeout);
  auto work = std::make_shared<Work>(record->description,
                                     std::make_shared<NcclWorkEvent>(record));
  absl::Status broken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    broken = broken_;
    if (broken.ok()) outstanding_.push_back(record);
  }
  if (!broken.ok()) {  // Fail fast with the error that broke the group.
    record->Enqueued(nullptr);
    record->Fail(broken);
    return work;
  }
  if (collective) heartbeat_.MarkStarted(seq);
  absl::Status status;
  {
    DeviceGuard guard(cuda_device_);
    status = guard.status();
    if (status.ok()) status = OrderAfter(stream, options.after);
    if (status.ok()) {
      OpContext context{stream->get(), comm_, record.get(), &abort_requested_,
                        allocator_};
      status = body(context);
    }
    // Marks the end of whatever reached the stream, even if the op failed
    // halfway, so its scratch outlives its kernels.
    absl::StatusOr<std::shared_ptr<CudaEvent>> done = CudaEvent::RecordOn(
        stream->get(), cuda_device_,
        absl::StrCat(stream->name(), collective ? "#" : "#p2p", number));
    record->Enqueued(done.ok() ? *done : nullptr);
    if (status.ok()) status = done.status();
  }
  if (status.ok()) {
    cv_.notify_all();
    return work;
  }
  // If an abort is underway, the watchdog is breaking the group for an
  // earlier op and fails this one with it.
  if (!abort_requested_) {
    abort_requested_ = true;
    BreakLocked(FailureStatus(
        *record,
        absl::IsDeadlineExceeded(status) ? absl::StatusCode::kDeadlineExceeded
                                         : absl::StatusCode::kUnavailable,
        absl::StrCat(status.message(), "; communicator aborted")));
  }
  return work;
}

absl::Status NcclProcessGroup::FailureStatus(const NcclOpRecord& op,
                                             absl::StatusCode code,
                                             const std::string& what) {
  return absl::Status(
      code, absl::StrCat(op.description, " failed (timeout ",
                         absl::FormatDuration(op.timeout), "): ", what, "; ",
                         heartbeat_.DiagnosePeers(op.seq)));
}

void NcclProcessGroup::BreakLocked(const absl::Status& status) {
  abort_requested_ = true;
  std::vector<std::shared_ptr<NcclOpRecord>> ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return;
    broken_ = status;
    ops.swap(outstanding_);
  }
  // Resolve before aborting: the abort ends the kernels, which completes
  // their CUDA events, and that must not read as success.
  for (const auto& op : ops) op->Fail(status);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& op : ops) {
      if (op->HoldsScratch()) draining_.push_back(op);
    }
  }
  if (comm_ != nullptr) {
    DeviceGuard guard(cuda_device_);
    ncclResult_t r = ncclCommAbort(comm_);
    LOG_IF(WARNING, r != ncclSuccess)
        << "group '" << name_ << "' ncclCommAbort: " << ncclGetErrorString(r);
    comm_ = nullptr;
  }
  LOG(ERROR) << status.message();
  cv_.notify_all();
}

void NcclProcessGroup::WatchdogLoop() {
  if (cudaSetDevice(cuda_device_) != cudaSuccess) cudaGetLastError();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_watchdog_) {
    if (outstanding_.empty() && draining_.empty()) {
      cv_.wait(lock);
      continue;
    }
    std::vector<std::shared_ptr<NcclOpRecord>> ops = outstanding_;
    std::vector<std::shared_ptr<NcclOpRecord>> drain = draining_;
    lock.unlock();
    WatchdogCheck(ops);
    Drain(drain);
    lock.lock();
    cv_.wait_for(lock, absl::ToChronoNanoseconds(kWatchdogTick),
                 [this] { return stop_watchdog_; });
  }
}

void NcclProcessGroup::WatchdogCheck(
    const std::vector<std::shared_ptr<NcclOpRecord>>& ops) {
  std::vector<const NcclOpRecord*> finished;
  std::shared_ptr<NcclOpRecord> culprit, oldest;
  absl::StatusCode code = absl::StatusCode::kUnavailable;
  std::string what;
  const absl::Time now = absl::Now();
  for (const auto& op : ops) {
    if (op->Poll()) {
      finished.push_back(op.get());
      continue;
    }
    if (oldest == nullptr && !op->Issuing()) oldest = op;
    if (culprit != nullptr) continue;
    if (cudaError_t e = op->EventError(); e != cudaSuccess) {
      culprit = op;
      code = absl::StatusCode::kInternal;
      what = CudaStatus(e, "CUDA error").ToString();
    } else if (now >= op->deadline && !op->Issuing()) {
      culprit = op;
      code = absl::StatusCode::kDeadlineExceeded;
      what = absl::StrCat("not complete after ",
                          absl::FormatDuration(op->timeout));
    }
  }
  if (!finished.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_.erase(
        std::remove_if(outstanding_.begin(), outstanding_.end(),
                       [&](const std::shared_ptr<NcclOpRecord>& op) {
                         return std::find(finished.begin(), finished.end(),
                                          op.get()) != finished.end();
                       }),
        outstanding_.end());
    cv_.notify_all();
  }
  if (oldest != nullptr) {
    // Skipped while an issuer holds the communicator: it polls the same
    // state itself.
    std::unique_lock<std::mutex> comm_lock(comm_mu_, std::try_to_lock);
    if (comm_lock.owns_lock() && comm_ != nullptr) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) state = r;
      if (state != ncclSuccess && state != ncclInProgress) {
        if (culprit == nullptr) culprit = oldest;
        code = absl::StatusCode::kUnavailable;
        what = absl::StrCat("NCCL error: ", NcclErrorText(comm_, state));
      } else if (culprit != nullptr &&
                 code == absl::StatusCode::kDeadlineExceeded) {
        absl::StrAppend(&what, " (NCCL: ", ncclGetErrorString(state), ")");
      }
    }
  }
  if (culprit == nullptr) return;
  abort_requested_ = true;  // Makes a polling issuer give comm_mu_ up.
  absl::Status status = FailureStatus(
      *culprit, code, absl::StrCat(what, "; communicator aborted"));
  std::lock_guard<std::mutex> comm_lock(comm_mu_);
  BreakLocked(status);
}

void NcclProcessGroup::Drain(
    const std::vector<std::shared_ptr<NcclOpRecord>>& ops) {
  std::vector<const NcclOpRecord*> drained;
  for (const auto& op : ops) {
    if (op->ReleaseScratch(absl::ZeroDuration(), false)) {
      drained.push_back(op.get());
    }
  }
  if (drained.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  draining_.erase(std::remove_if(draining_.begin(), draining_.end(),
                                 [&](const std::shared_ptr<NcclOpRecord>& op) {
                                   return std::find(drained.begin(),
                                                    drained.end(),
                                                    op.get()) != drained.end();
                                 }),
                  draining_.end());
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::AllGather(
    const Buffer& input, const Buffer& output,
    const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateAllGather(*this, input, output));
  // In place (input at output + rank * bytes) is native to ncclAllGather.
  return Issue("all_gather", input.ToString(), options,
               [input, output](OpContext& ctx) -> absl::Status {
                 const size_t bytes = input.nbytes();
                 if (bytes == 0) return absl::OkStatus();
                 FSDPP_RETURN_IF_ERROR(
                     ctx.Check(ncclAllGather(input.data, output.data, bytes,
                                             ncclUint8, ctx.comm, ctx.stream),
                               "ncclAllGather"));
                 return absl::OkStatus();
               });
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::ReduceScatter(
    const Buffer& input, const Buffer& output, ReduceOp op,
    const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateReduceScatter(*this, input, output, op));
  return Issue(
      "reduce_scatter", absl::StrCat(input.ToString(), ", ", ReduceOpName(op)),
      options, [this, input, output, op](OpContext& ctx) -> absl::Status {
        const int64_t n = input.count;
        if (n == 0) return absl::OkStatus();
        const int64_t chunk = (n + size_ - 1) / size_;
        const int64_t padded = chunk * size_;
        const int64_t count = output.count;  // This rank's part of its chunk.
        const bool widen = ReducesInF32(input.dtype);
        const DType wire = widen ? DType::kF32 : input.dtype;
        const size_t esize = DTypeSize(wire);
        // Send the input as is unless it needs widening or zero padding to
        // `size` equal chunks.
        const void* send = input.data;
        if (widen || padded != n) {
          FSDPP_ASSIGN_OR_RETURN(void* staged, ctx.Scratch(padded * esize));
          if (widen) {
            FSDPP_RETURN_IF_ERROR(CastToF32Async(input.data, input.dtype,
                                                 static_cast<float*>(staged), n,
                                                 ctx.stream));
          } else {
            FSDPP_CUDA_RETURN_IF_ERROR(
                cudaMemcpyAsync(staged, input.data, n * esize,
                                cudaMemcpyDeviceToDevice, ctx.stream));
          }
          if (padded != n) {
            FSDPP_CUDA_RETURN_IF_ERROR(
                cudaMemsetAsync(static_cast<char*>(staged) + n * esize, 0,
                                (padded - n) * esize, ctx.stream));
          }
          send = staged;
        }
        // Receive straight into the output when it is a whole chunk of the
        // wire type; else into a chunk of scratch, copied or cast out.
        const bool direct = !widen && count == chunk;
        void* recv = output.data;
        if (!direct) {
          FSDPP_ASSIGN_OR_RETURN(recv, ctx.Scratch(chunk * esize));
        }
        FSDPP_RETURN_IF_ERROR(ctx.Check(
            ncclReduceScatter(send, recv, chunk, NcclType(wire),
                              NcclRedOp(op, size_), ctx.comm, ctx.stream),
            "ncclReduceScatter"));
        if (!direct && count > 0) {
          if (widen) {
            FSDPP_RETURN_IF_ERROR(
                CastFromF32Async(static_cast<const float*>(recv), output.dtype,
                                 output.data, count, ctx.stream));
          } else {
            FSDPP_CUDA_RETURN_IF_ERROR(
                cudaMemcpyAsync(output.data, recv, count * esize,
                                cudaMemcpyDeviceToDevice, ctx.stream));
          }
        }
        return absl::OkStatus();
      });
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::AllReduce(
    const Buffer& buffer, ReduceOp op, const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateAllReduce(*this, buffer, op));
  return Issue(
      "all_reduce", absl::StrCat(buffer.ToString(), ", ", ReduceOpName(op)),
      options, [this, buffer, op](OpContext& ctx) -> absl::Status {
        const int64_t n = buffer.count;
        if (n == 0) return absl::OkStatus();
        if (!ReducesInF32(buffer.dtype)) {
          FSDPP_RETURN_IF_ERROR(ctx.Check(
              ncclAllReduce(buffer.data, buffer.data, n, NcclType(buffer.dtype),
                            NcclRedOp(op, size_), ctx.comm, ctx.stream),
              "ncclAllReduce"));
          return absl::OkStatus();
        }
        FSDPP_ASSIGN_OR_RETURN(void* scratch, ctx.Scratch(n * sizeof(float)));
        float* wide = static_cast<float*>(scratch);
        FSDPP_RETURN_IF_ERROR(
            CastToF32Async(buffer.data, buffer.dtype, wide, n, ctx.stream));
        FSDPP_RETURN_IF_ERROR(
            ctx.Check(ncclAllReduce(wide, wide, n, ncclFloat32,
                                    NcclRedOp(op, size_), ctx.comm, ctx.stream),
                      "ncclAllReduce"));
        return CastFromF32Async(wide, buffer.dtype, buffer.data, n, ctx.stream);
      });
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::Broadcast(
    const Buffer& buffer, int root, const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateBroadcast(*this, buffer, root));
  return Issue("broadcast", absl::StrCat(buffer.ToString(), ", root ", root),
               options, [buffer, root](OpContext& ctx) -> absl::Status {
                 if (buffer.count == 0) return absl::OkStatus();
                 FSDPP_RETURN_IF_ERROR(ctx.Check(
                     ncclBroadcast(buffer.data, buffer.data, buffer.nbytes(),
                                   ncclUint8, root, ctx.comm, ctx.stream),
                     "ncclBroadcast"));
                 return absl::OkStatus();
               });
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::AllToAll(
    const Buffer& input, const Buffer& output,
    const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateAllToAll(*this, input, output));
  return Issue(
      "all_to_all", input.ToString(), options,
      [this, input, output](OpContext& ctx) -> absl::Status {
        const size_t bytes = input.nbytes();
        if (bytes == 0) return absl::OkStatus();
        const size_t per_peer = bytes / size_;
        const char* send = static_cast<const char*>(input.data);
        char* recv = static_cast<char*>(output.data);
        if (input.data == output.data) {  // Stage the input: peers overwrite.
          FSDPP_ASSIGN_OR_RETURN(void* staged, ctx.Scratch(bytes));
          FSDPP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
              staged, input.data, bytes, cudaMemcpyDeviceToDevice, ctx.stream));
          send = static_cast<const char*>(staged);
        }
        FSDPP_RETURN_IF_ERROR(ctx.Check(ncclGroupStart(), "ncclGroupStart"));
        absl::Status status;
        for (int peer = 0; peer < size_ && status.ok(); ++peer) {
          status = ctx.Check(ncclSend(send + peer * per_peer, per_peer,
                                      ncclUint8, peer, ctx.comm, ctx.stream),
                             "ncclSend");
          if (status.ok()) {
            status = ctx.Check(ncclRecv(recv + peer * per_peer, per_peer,
                                        ncclUint8, peer, ctx.comm, ctx.stream),
                               "ncclRecv");
          }
        }
        // The group is closed even after an error inside it.
        absl::Status end = ctx.Check(ncclGroupEnd(), "ncclGroupEnd");
        return status.ok() ? end : status;
      });
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::AllToAllV(
    const Buffer& input, const std::vector<int64_t>& input_splits,
    const Buffer& output, const std::vector<int64_t>& output_splits,
    const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(
      ValidateAllToAllV(*this, input, input_splits, output, output_splits));
  return Issue(
      "all_to_all_v", AllToAllVDetail(input.dtype, input_splits, output_splits),
      options,
      [this, input, input_splits, output,
       output_splits](OpContext& ctx) -> absl::Status {
        if (input.nbytes() == 0 && output.nbytes() == 0) {
          return absl::OkStatus();
        }
        // The buffers are distinct (validated): no staging.
        const size_t elem = DTypeSize(input.dtype);
        const char* send = static_cast<const char*>(input.data);
        char* recv = static_cast<char*>(output.data);
        FSDPP_RETURN_IF_ERROR(ctx.Check(ncclGroupStart(), "ncclGroupStart"));
        absl::Status status;
        size_t send_offset = 0, recv_offset = 0;
        for (int peer = 0; peer < size_ && status.ok(); ++peer) {
          const size_t send_bytes = input_splits[peer] * elem;
          const size_t recv_bytes = output_splits[peer] * elem;
          if (send_bytes > 0) {
            status = ctx.Check(ncclSend(send + send_offset, send_bytes,
                                        ncclUint8, peer, ctx.comm, ctx.stream),
                               "ncclSend");
          }
          if (status.ok() && recv_bytes > 0) {
            status = ctx.Check(ncclRecv(recv + recv_offset, recv_bytes,
                                        ncclUint8, peer, ctx.comm, ctx.stream),
                               "ncclRecv");
          }
          send_offset += send_bytes;
          recv_offset += recv_bytes;
        }
        // The group is closed even after an error inside it.
        absl::Status end = ctx.Check(ncclGroupEnd(), "ncclGroupEnd");
        return status.ok() ? end : status;
      });
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::Barrier(
    const CollectiveOptions& options) {
  return Issue("barrier", "", options, [](OpContext& ctx) -> absl::Status {
    FSDPP_ASSIGN_OR_RETURN(void* flag, ctx.Scratch(sizeof(int32_t)));
    FSDPP_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(flag, 0, sizeof(int32_t), ctx.stream));
    FSDPP_RETURN_IF_ERROR(ctx.Check(
        ncclAllReduce(flag, flag, 1, ncclInt32, ncclSum, ctx.comm, ctx.stream),
        "ncclAllReduce"));
    return absl::OkStatus();
  });
}

absl::StatusOr<std::shared_ptr<Work>> NcclProcessGroup::BatchP2P(
    const std::vector<P2POp>& ops, const CollectiveOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateP2P(*this, ops));
  for (const P2POp& op : ops) {
    if (op.tag != 0) {
      return absl::UnimplementedError(absl::StrCat(
          "p2p on NCCL group '", name(), "': tag ", op.tag,
          ": NCCL matches transfers in issue order, tags are not supported"));
    }
  }
  return Issue(
      "p2p", P2PDetail(ops), options,
      [ops](OpContext& ctx) -> absl::Status {
        // One NCCL group: the transfers progress together, matched with the
        // peers' in the order each pair issues them.
        FSDPP_RETURN_IF_ERROR(ctx.Check(ncclGroupStart(), "ncclGroupStart"));
        absl::Status status;
        for (const P2POp& op : ops) {
          const size_t bytes = op.buffer.nbytes();
          if (bytes == 0 || !status.ok()) continue;
          status = op.kind == P2POp::Kind::kSend
                       ? ctx.Check(ncclSend(op.buffer.data, bytes, ncclUint8,
                                            op.peer, ctx.comm, ctx.stream),
                                   "ncclSend")
                       : ctx.Check(ncclRecv(op.buffer.data, bytes, ncclUint8,
                                            op.peer, ctx.comm, ctx.stream),
                                   "ncclRecv");
        }
        // The group is closed even after an error inside it.
        absl::Status end = ctx.Check(ncclGroupEnd(), "ncclGroupEnd");
        return status.ok() ? end : status;
      },
      /*collective=*/false);
}

ProcessGroupFactory NcclGroupFactory(Store* store, int cuda_device,
                                     NcclOptions options) {
  return [store, cuda_device, options](
             const std::string& name, int rank,
             int size) -> absl::StatusOr<std::unique_ptr<ProcessGroup>> {
    FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<NcclProcessGroup> group,
                           NcclProcessGroup::Create(store, rank, size, name,
                                                    cuda_device, options));
    return std::unique_ptr<ProcessGroup>(std::move(group));
  };
}

}  // namespace fsdpp
