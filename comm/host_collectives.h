// Collectives of small host values: the numbers and strings a training loop
// agrees on between steps (the loss, timings, memory tables, trace pieces),
// in the spirit of c10d's all_gather_object. Each call is blocking (issued
// and waited for on the caller's thread, no comm-thread hand-off) and bounded
// by `timeout` on top of the group's own op timeout.
//
// The values travel in host memory, so the group must accept host buffers
// (Gloo; a GPU run keeps a Gloo group over the same store for this, as
// PyTorch does). Doubles are reduced in f32, the collectives' float type:
// these are values for logs and decisions, not for the model.
#ifndef FSDPP_COMM_HOST_COLLECTIVES_H_
#define FSDPP_COMM_HOST_COLLECTIVES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/process_group.h"

namespace fsdpp {

// The host-side bound of these calls' waits: a backstop behind the group's
// own op timeout, reached only if a comm thread itself hangs.
inline constexpr absl::Duration kHostCollectiveTimeout = absl::Minutes(10);

// Reduces `values` element-wise over the ranks of `group`, in place (in f32).
absl::Status AllReduceValues(ProcessGroup* group, std::vector<double>* values,
                             ReduceOp op,
                             absl::Duration timeout = kHostCollectiveTimeout);

// Every rank's `values` (the same count on each), concatenated in rank order.
absl::StatusOr<std::vector<int64_t>> AllGatherInts(
    ProcessGroup* group, const std::vector<int64_t>& values,
    absl::Duration timeout = kHostCollectiveTimeout);

// Every rank's string, in rank order (two all-gathers: the sizes, then the
// bytes padded to the longest).
absl::StatusOr<std::vector<std::string>> AllGatherStrings(
    ProcessGroup* group, const std::string& mine,
    absl::Duration timeout = kHostCollectiveTimeout);

}  // namespace fsdpp

#endif  // FSDPP_COMM_HOST_COLLECTIVES_H_
