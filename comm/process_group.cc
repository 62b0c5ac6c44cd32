// Work, chunk arithmetic and argument validation; see process_group.h.
#include "comm/process_group.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/device_wait.h"

namespace fsdpp {

std::string Buffer::ToString() const {
  return absl::StrCat(count, " x ", DTypeName(dtype), " on ",
                      device.ToString());
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

absl::Status Work::WaitForCompute(Device compute,
                                  absl::Duration timeout) const {
  if (compute.is_cuda()) {
    if (void* handle = event_->cuda_event_handle(); handle != nullptr) {
      return ComputeStreamWaitEvent(compute, handle);
    }
  }
  return Wait(timeout);
}

absl::Status Work::Wait(absl::Duration timeout) const {
  absl::Status status = event_->Wait(timeout);
  if (absl::IsDeadlineExceeded(status) && !event_->IsCompleted()) {
    return absl::DeadlineExceededError(absl::StrCat(
        description_, " still running after ", absl::FormatDuration(timeout)));
  }
  return status;
}

int64_t ReduceScatterCount(int64_t n, int size, int rank) {
  const int64_t chunk = (n + size - 1) / size;
  const int64_t begin = std::min(n, rank * chunk);
  const int64_t end = std::min(n, (rank + 1) * chunk);
  return end - begin;
}

int64_t ReduceScatterOffset(int64_t n, int size, int rank) {
  const int64_t chunk = (n + size - 1) / size;
  return std::min(n, rank * chunk);
}

namespace {

absl::Status Invalid(const ProcessGroup& group, const char* op,
                     absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(op, " on group '", group.name(), "' (rank ", group.rank(),
                   " of ", group.size(), "): ", what));
}

absl::Status CheckBuffer(const ProcessGroup& group, const char* op,
                         const char* name, const Buffer& b) {
  if (b.count < 0) {
    return Invalid(group, op, absl::StrCat(name, " has a negative count"));
  }
  // Meta buffers (a dry run's) have no data.
  if (b.count > 0 && b.data == nullptr &&
      b.device.type() != DeviceType::kMeta) {
    return Invalid(group, op, absl::StrCat(name, " is null"));
  }
  if (b.device != group.device()) {
    return Invalid(
        group, op,
        absl::StrCat(name, " is on ", b.device.ToString(),
                     ", the group works on ", group.device().ToString()));
  }
  return absl::OkStatus();
}

absl::Status CheckReduceOp(const ProcessGroup& group, const char* op,
                           DType dtype, ReduceOp reduce) {
  if (reduce == ReduceOp::kAvg && !IsFloatingPoint(dtype)) {
    return Invalid(
        group, op,
        absl::StrCat("avg needs a float dtype, not ", DTypeName(dtype)));
  }
  if (dtype == DType::kU8 && reduce != ReduceOp::kMax) {
    return Invalid(group, op, "u8 buffers only reduce with max");
  }
  return absl::OkStatus();
}

// CheckBuffer on the input, then the output, of a two-buffer collective.
absl::Status CheckInputAndOutput(const ProcessGroup& group, const char* op,
                                 const Buffer& input, const Buffer& output) {
  if (absl::Status s = CheckBuffer(group, op, "input", input); !s.ok())
    return s;
  return CheckBuffer(group, op, "output", output);
}

// CheckInputAndOutput, then that input and output have one dtype.
absl::Status CheckInputAndOutputDType(const ProcessGroup& group, const char* op,
                                      const Buffer& input,
                                      const Buffer& output) {
  if (absl::Status s = CheckInputAndOutput(group, op, input, output); !s.ok())
    return s;
  if (input.dtype != output.dtype) {
    return Invalid(group, op,
                   absl::StrCat("input is ", DTypeName(input.dtype),
                                ", output is ", DTypeName(output.dtype)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateAllGather(const ProcessGroup& group, const Buffer& input,
                               const Buffer& output) {
  constexpr const char* kOp = "all_gather";
  if (absl::Status s = CheckInputAndOutputDType(group, kOp, input, output);
      !s.ok()) {
    return s;
  }
  if (output.count != input.count * group.size()) {
    return Invalid(group, kOp,
                   absl::StrCat("output has ", output.count,
                                " elements, expected input count ", input.count,
                                " x ", group.size(), " ranks"));
  }
  return absl::OkStatus();
}

absl::Status ValidateAllGatherRuns(
    const ProcessGroup& group, const Buffer& output,
    const std::vector<std::vector<BufferRun>>& runs) {
  constexpr const char* kOp = "all_gather (runs)";
  if (absl::Status s = CheckBuffer(group, kOp, "output", output); !s.ok()) {
    return s;
  }
  if (static_cast<int>(runs.size()) != group.size()) {
    return Invalid(group, kOp,
                   absl::StrCat(runs.size(), " lists of runs for ",
                                group.size(), " ranks"));
  }
  std::vector<BufferRun> all;
  for (int r = 0; r < group.size(); ++r) {
    for (const BufferRun& run : runs[r]) {
      if (run.offset < 0 || run.count < 0 ||
          run.count > output.count - run.offset) {
        return Invalid(group, kOp,
                       absl::StrCat("rank ", r, "'s run [", run.offset, ", ",
                                    run.offset + run.count,
                                    ") is not inside the output's ",
                                    output.count, " elements"));
      }
      if (run.count > 0) all.push_back(run);
    }
  }
  std::sort(all.begin(), all.end(), [](const BufferRun& a, const BufferRun& b) {
    return a.offset < b.offset;
  });
  for (size_t i = 1; i < all.size(); ++i) {
    if (all[i].offset < all[i - 1].offset + all[i - 1].count) {
      return Invalid(group, kOp,
                     absl::StrCat("runs [", all[i - 1].offset, ", ",
                                  all[i - 1].offset + all[i - 1].count,
                                  ") and [", all[i].offset, ", ",
                                  all[i].offset + all[i].count, ") overlap"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Work>> ProcessGroup::AllGatherRuns(
    const Buffer& /*output*/,
    const std::vector<std::vector<BufferRun>>& /*runs*/,
    const CollectiveOptions& /*options*/) {
  return absl::UnimplementedError(
      absl::StrCat("all_gather (runs) on group '", name(),
                   "': this backend gathers in rank order only "
                   "(AllGathersRuns() is false)"));
}

absl::Status ValidateReduceScatter(const ProcessGroup& group,
                                   const Buffer& input, const Buffer& output,
                                   ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter";
  const bool widens =
      group.ReduceScatterWidens() && output.dtype == DType::kF32 &&
      (input.dtype == DType::kBF16 || input.dtype == DType::kF16);
  if (absl::Status s =
          widens ? CheckInputAndOutput(group, kOp, input, output)
                 : CheckInputAndOutputDType(group, kOp, input, output);
      !s.ok()) {
    return s;
  }
  const int64_t expected =
      ReduceScatterCount(input.count, group.size(), group.rank());
  if (output.count != expected) {
    return Invalid(group, kOp,
                   absl::StrCat("output has ", output.count, " elements, rank ",
                                group.rank(), "'s chunk of ", input.count,
                                " has ", expected));
  }
  return CheckReduceOp(group, kOp, input.dtype, op);
}

absl::Status ValidateReduceScatterSpans(
    const ProcessGroup& group, DType dtype,
    const std::vector<std::vector<BufferSpan>>& spans, const Buffer& output,
    ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter (spans)";
  if (absl::Status s = CheckBuffer(group, kOp, "output", output); !s.ok()) {
    return s;
  }
  const bool widens = group.ReduceScatterWidens() &&
                      output.dtype == DType::kF32 &&
                      (dtype == DType::kBF16 || dtype == DType::kF16);
  if (dtype != output.dtype && !widens) {
    return Invalid(group, kOp,
                   absl::StrCat("input is ", DTypeName(dtype), ", output is ",
                                DTypeName(output.dtype)));
  }
  if (static_cast<int>(spans.size()) != group.size()) {
    return Invalid(group, kOp,
                   absl::StrCat(spans.size(), " lists of spans for ",
                                group.size(), " ranks"));
  }
  for (int q = 0; q < group.size(); ++q) {
    for (const BufferSpan& span : spans[q]) {
      if (span.count < 0) {
        return Invalid(group, kOp,
                       absl::StrCat("a span of rank ", q,
                                    "'s chunk has a negative count"));
      }
    }
  }
  if (const int64_t mine = ElementsIn(spans[group.rank()]);
      mine != output.count) {
    return Invalid(group, kOp,
                   absl::StrCat("this rank's spans hold ", mine,
                                " elements, its output ", output.count));
  }
  return CheckReduceOp(group, kOp, dtype, op);
}

absl::StatusOr<std::shared_ptr<Work>> ProcessGroup::ReduceScatterSpans(
    DType /*dtype*/, const std::vector<std::vector<BufferSpan>>& /*spans*/,
    const Buffer& /*output*/, ReduceOp /*op*/,
    const CollectiveOptions& /*options*/) {
  return absl::UnimplementedError(
      absl::StrCat("reduce_scatter (spans) on group '", name(),
                   "': this backend reduces one input buffer only "
                   "(ReduceScattersSpans() is false)"));
}

absl::Status ValidateAllReduce(const ProcessGroup& group, const Buffer& buffer,
                               ReduceOp op) {
  constexpr const char* kOp = "all_reduce";
  if (absl::Status s = CheckBuffer(group, kOp, "buffer", buffer); !s.ok())
    return s;
  return CheckReduceOp(group, kOp, buffer.dtype, op);
}

absl::Status ValidateBroadcast(const ProcessGroup& group, const Buffer& buffer,
                               int root) {
  constexpr const char* kOp = "broadcast";
  if (absl::Status s = CheckBuffer(group, kOp, "buffer", buffer); !s.ok())
    return s;
  if (root < 0 || root >= group.size()) {
    return Invalid(group, kOp, absl::StrCat("root ", root, " is not a rank"));
  }
  return absl::OkStatus();
}

absl::Status ValidateP2P(const ProcessGroup& group,
                         const std::vector<P2POp>& ops) {
  constexpr const char* kOp = "p2p";
  if (ops.empty()) return Invalid(group, kOp, "no sends or receives");
  for (const P2POp& op : ops) {
    const char* what = op.kind == P2POp::Kind::kSend ? "send" : "recv";
    if (absl::Status s = CheckBuffer(group, kOp, what, op.buffer); !s.ok()) {
      return s;
    }
    if (op.peer < 0 || op.peer >= group.size() || op.peer == group.rank()) {
      return Invalid(group, kOp,
                     absl::StrCat(what, " peer ", op.peer,
                                  " is not another rank of the group"));
    }
    if (op.tag < 0 || op.tag > P2POp::kMaxP2PTag) {
      return Invalid(group, kOp,
                     absl::StrCat(what, " tag ", op.tag, " is outside 0 .. ",
                                  P2POp::kMaxP2PTag));
    }
  }
  return absl::OkStatus();
}

std::string P2PDetail(const std::vector<P2POp>& ops) {
  std::vector<std::string> parts;
  for (const P2POp& op : ops) {
    parts.push_back(
        op.kind == P2POp::Kind::kSend
            ? absl::StrCat("send ", op.buffer.ToString(), " to ", op.peer)
            : absl::StrCat("recv ", op.buffer.ToString(), " from ", op.peer));
    if (op.tag != 0) absl::StrAppend(&parts.back(), " tag ", op.tag);
  }
  return absl::StrJoin(parts, ", ");
}

absl::Status ValidateAllToAll(const ProcessGroup& group, const Buffer& input,
                              const Buffer& output) {
  constexpr const char* kOp = "all_to_all";
  if (absl::Status s = CheckInputAndOutput(group, kOp, input, output); !s.ok())
    return s;
  if (input.dtype != output.dtype || input.count != output.count) {
    return Invalid(group, kOp,
                   absl::StrCat("input (", input.ToString(), ") and output (",
                                output.ToString(), ") differ"));
  }
  if (input.count % group.size() != 0) {
    return Invalid(group, kOp,
                   absl::StrCat(input.count, " elements do not split into ",
                                group.size(), " equal chunks"));
  }
  return absl::OkStatus();
}

namespace {

// That `splits` (named `name`) has one count >= 0 per rank and sums to
// `buffer`'s count (`what`: "input" or "output").
absl::Status CheckSplits(const ProcessGroup& group, const char* op,
                         const char* name, const std::vector<int64_t>& splits,
                         const char* what, const Buffer& buffer) {
  if (splits.size() != static_cast<size_t>(group.size())) {
    return Invalid(
        group, op,
        absl::StrCat(name, " has ", splits.size(), " entries, the group has ",
                     group.size(), " ranks"));
  }
  int64_t sum = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    if (splits[i] < 0) {
      return Invalid(
          group, op,
          absl::StrCat(name, "[", i, "] is negative (", splits[i], ")"));
    }
    if (__builtin_add_overflow(sum, splits[i], &sum)) {
      return Invalid(group, op, absl::StrCat(name, " overflow int64"));
    }
  }
  if (sum != buffer.count) {
    return Invalid(group, op,
                   absl::StrCat(name, " sum to ", sum, " but ", what, " has ",
                                buffer.count, " elements"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateAllToAllV(const ProcessGroup& group, const Buffer& input,
                               const std::vector<int64_t>& input_splits,
                               const Buffer& output,
                               const std::vector<int64_t>& output_splits) {
  constexpr const char* kOp = "all_to_all_v";
  if (absl::Status s = CheckInputAndOutputDType(group, kOp, input, output);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckSplits(group, kOp, "input_splits", input_splits, "input", input);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSplits(group, kOp, "output_splits", output_splits,
                                   "output", output);
      !s.ok()) {
    return s;
  }
  const int rank = group.rank();
  if (input_splits[rank] != output_splits[rank]) {
    return Invalid(
        group, kOp,
        absl::StrCat("input_splits[", rank, "] (", input_splits[rank],
                     ") and output_splits[", rank, "] (", output_splits[rank],
                     ") differ: both size the chunk this rank keeps"));
  }
  if (input.count > 0 && output.count > 0) {
    // As integers: the two may be unrelated objects.
    const uintptr_t in = reinterpret_cast<uintptr_t>(input.data);
    const uintptr_t out = reinterpret_cast<uintptr_t>(output.data);
    if (std::max(in, out) <
        std::min(in + input.nbytes(), out + output.nbytes())) {
      return Invalid(group, kOp,
                     "input and output overlap (they must be distinct "
                     "buffers)");
    }
  }
  return absl::OkStatus();
}

std::string AllToAllVDetail(DType dtype,
                            const std::vector<int64_t>& input_splits,
                            const std::vector<int64_t>& output_splits) {
  return absl::StrCat("send [", absl::StrJoin(input_splits, ", "), "], recv [",
                      absl::StrJoin(output_splits, ", "), "] x ",
                      DTypeName(dtype));
}

}  // namespace fsdpp
