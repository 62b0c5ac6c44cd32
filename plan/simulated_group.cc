// SimulatedProcessGroup; see simulated_group.h.
#include "plan/simulated_group.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/gloo_backend.h"
#include "core/allocator.h"
#include "core/status.h"

namespace fsdpp {
namespace plan {

void SimulatedOpLog::Add(SimulatedOp op) {
  std::lock_guard<std::mutex> lock(mu_);
  ops_.push_back(std::move(op));
}

std::vector<SimulatedOp> SimulatedOpLog::ops() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_;
}

void SimulatedOpLog::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  ops_.clear();
}

SimulatedProcessGroup::SimulatedProcessGroup(std::string name, int rank,
                                             int size, SimulatedOpLog* log,
                                             SimulatedBackend backend)
    : name_(std::move(name)),
      rank_(rank),
      size_(size),
      log_(log),
      backend_(backend),
      stream_(absl::StrCat(name_, " (simulated)")) {}

SimulatedProcessGroup::~SimulatedProcessGroup() {
  Allocator* accountant = GetAllocator(device());
  if (accountant == nullptr) return;
  for (const auto& [stream, bytes] : held_) {
    accountant->Deallocate(nullptr, bytes, MemoryTag::kCommBuffers);
  }
}

absl::Status SimulatedProcessGroup::Scratch(const CollectiveOptions& options,
                                            int64_t held, int64_t transient) {
  if (backend_ == SimulatedBackend::kNccl) return absl::OkStatus();
  Allocator* accountant = GetAllocator(device());
  if (accountant == nullptr) return absl::OkStatus();  // nothing counts
  const Stream* stream = options.stream != nullptr ? options.stream : &stream_;
  std::lock_guard<std::mutex> lock(mu_);
  int64_t& have = held_[stream];
  if (held > have) {
    // As StreamScratch::Get: the old area is freed, a larger one allocated.
    if (have > 0) {
      accountant->Deallocate(nullptr, have, MemoryTag::kCommBuffers);
    }
    FSDPP_RETURN_IF_ERROR(
        accountant->Allocate(held, MemoryTag::kCommBuffers).status());
    have = held;
  }
  if (transient > 0) {
    FSDPP_RETURN_IF_ERROR(
        accountant->Allocate(transient, MemoryTag::kCommBuffers).status());
    accountant->Deallocate(nullptr, transient, MemoryTag::kCommBuffers);
  }
  return absl::OkStatus();
}

std::shared_ptr<Work> SimulatedProcessGroup::Done(const char* kind,
                                                  int64_t in_bytes,
                                                  int64_t out_bytes) {
  if (log_ != nullptr) {
    log_->Add({kind, name_, size_, in_bytes, out_bytes});
  }
  return std::make_shared<Work>(
      absl::StrCat(kind, " on group '", name_, "' (simulated)"), HostEvent());
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::AllGather(
    const Buffer& input, const Buffer& output, const CollectiveOptions&) {
  return Done("all_gather", input.nbytes(), output.nbytes());
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::AllGatherRuns(
    const Buffer& output, const std::vector<std::vector<BufferRun>>& runs,
    const CollectiveOptions& options) {
  if (!AllGathersRuns()) {
    return ProcessGroup::AllGatherRuns(output, runs, options);
  }
  FSDPP_RETURN_IF_ERROR(ValidateAllGatherRuns(*this, output, runs));
  const int64_t esize = static_cast<int64_t>(DTypeSize(output.dtype));
  return Done("all_gather", ElementsIn(runs[rank_]) * esize,
              ElementsIn(runs) * esize);
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::ReduceScatter(
    const Buffer& input, const Buffer& output, ReduceOp,
    const CollectiveOptions& options) {
  const GlooScratch s = GlooReduceScatterScratch(
      input.count, input.dtype, output.dtype, output.count, size_,
      backend_ == SimulatedBackend::kGlooSharedMemory);
  FSDPP_RETURN_IF_ERROR(Scratch(options, s.held, s.transient));
  return Done("reduce_scatter", input.nbytes(), output.nbytes());
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::ReduceScatterSpans(
    DType dtype, const std::vector<std::vector<BufferSpan>>& spans,
    const Buffer& output, ReduceOp op, const CollectiveOptions& options) {
  if (!ReduceScattersSpans()) {
    return ProcessGroup::ReduceScatterSpans(dtype, spans, output, op, options);
  }
  FSDPP_RETURN_IF_ERROR(
      ValidateReduceScatterSpans(*this, dtype, spans, output, op));
  const int64_t n = ElementsIn(spans);
  const GlooScratch s = GlooReduceScatterScratch(
      n, dtype, output.dtype, output.count, size_, /*shared_memory=*/true);
  FSDPP_RETURN_IF_ERROR(Scratch(options, s.held, s.transient));
  return Done("reduce_scatter", n * static_cast<int64_t>(DTypeSize(dtype)),
              output.nbytes());
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::AllReduce(
    const Buffer& buffer, ReduceOp, const CollectiveOptions& options) {
  const GlooScratch s = GlooAllReduceScratch(buffer.count, buffer.dtype, size_);
  FSDPP_RETURN_IF_ERROR(Scratch(options, s.held, s.transient));
  return Done("all_reduce", buffer.nbytes(), buffer.nbytes());
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::Broadcast(
    const Buffer& buffer, int, const CollectiveOptions&) {
  return Done("broadcast", buffer.nbytes(), buffer.nbytes());
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::AllToAll(
    const Buffer& input, const Buffer& output, const CollectiveOptions&) {
  return Done("all_to_all", input.nbytes(), output.nbytes());
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::AllToAllV(
    const Buffer& input, const std::vector<int64_t>&, const Buffer& output,
    const std::vector<int64_t>&, const CollectiveOptions&) {
  return Done("all_to_all_v", input.nbytes(), output.nbytes());
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::Barrier(
    const CollectiveOptions&) {
  return Done("barrier", 0, 0);
}

absl::StatusOr<std::shared_ptr<Work>> SimulatedProcessGroup::BatchP2P(
    const std::vector<P2POp>& ops, const CollectiveOptions&) {
  int64_t sent = 0, received = 0;
  for (const P2POp& op : ops) {
    (op.kind == P2POp::Kind::kSend ? sent : received) += op.buffer.nbytes();
  }
  return Done("p2p", sent, received);
}

ProcessGroupFactory SimulatedGroupFactory(SimulatedOpLog* log,
                                          SimulatedBackend backend) {
  return [log, backend](
             const std::string& name, int rank,
             int size) -> absl::StatusOr<std::unique_ptr<ProcessGroup>> {
    return std::unique_ptr<ProcessGroup>(
        std::make_unique<SimulatedProcessGroup>(name, rank, size, log,
                                                backend));
  };
}

}  // namespace plan
}  // namespace fsdpp
