// Collectives of host values; see host_collectives.h.
#include "comm/host_collectives.h"

#include <algorithm>
#include <memory>

#include "core/status.h"

namespace fsdpp {
namespace {

// Issues `op` blocking and waits for it.
template <typename Op>
absl::Status Blocking(Op op, absl::Duration timeout) {
  CollectiveOptions options;  // the group's op timeout
  options.async_op = false;   // waited for at once: no comm-thread hand-offs
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work, op(options));
  return work->Wait(timeout);
}

Buffer HostBuffer(void* data, int64_t count, DType dtype) {
  return Buffer{data, count, dtype, Device::Cpu()};
}

// Every rank's `count` elements of `in` into `out` (count x ranks), in rank
// order.
absl::Status AllGatherHost(ProcessGroup* group, void* in, void* out,
                           int64_t count, DType dtype, absl::Duration timeout) {
  return Blocking(
      [&](const CollectiveOptions& o) {
        return group->AllGather(HostBuffer(in, count, dtype),
                                HostBuffer(out, count * group->size(), dtype),
                                o);
      },
      timeout);
}

}  // namespace

absl::Status AllReduceValues(ProcessGroup* group, std::vector<double>* values,
                             ReduceOp op, absl::Duration timeout) {
  std::vector<float> f(values->begin(), values->end());
  FSDPP_RETURN_IF_ERROR(Blocking(
      [&](const CollectiveOptions& o) {
        return group->AllReduce(
            HostBuffer(f.data(), static_cast<int64_t>(f.size()), DType::kF32),
            op, o);
      },
      timeout));
  std::copy(f.begin(), f.end(), values->begin());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> AllGatherInts(
    ProcessGroup* group, const std::vector<int64_t>& values,
    absl::Duration timeout) {
  std::vector<int64_t> in = values;
  std::vector<int64_t> out(in.size() * group->size());
  FSDPP_RETURN_IF_ERROR(AllGatherHost(group, in.data(), out.data(),
                                      static_cast<int64_t>(in.size()),
                                      DType::kI64, timeout));
  return out;
}

absl::StatusOr<std::vector<std::string>> AllGatherStrings(
    ProcessGroup* group, const std::string& mine, absl::Duration timeout) {
  FSDPP_ASSIGN_OR_RETURN(
      std::vector<int64_t> sizes,
      AllGatherInts(group, {static_cast<int64_t>(mine.size())}, timeout));
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<uint8_t> in(std::max<int64_t>(longest, 1), 0);
  std::copy(mine.begin(), mine.end(), in.begin());
  std::vector<uint8_t> out(in.size() * group->size());
  FSDPP_RETURN_IF_ERROR(AllGatherHost(group, in.data(), out.data(),
                                      static_cast<int64_t>(in.size()),
                                      DType::kU8, timeout));
  std::vector<std::string> result;
  for (int r = 0; r < group->size(); ++r) {
    const char* begin =
        reinterpret_cast<const char*>(out.data()) + r * in.size();
    result.emplace_back(begin, begin + sizes[r]);
  }
  return result;
}

}  // namespace fsdpp
