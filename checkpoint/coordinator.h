// How the ranks of one checkpoint save agree: gather to rank 0 and broadcast
// from rank 0, either through a Store or through the mesh's collectives.
//
// Design: the two primitives are all a save needs (plans in, verdicts out),
// and both can be built on a key-value store, which is safe to use from a
// background thread while the training thread issues collectives: store
// operations never join a process group's sequence, so they cannot interleave
// with the training thread's collectives. The collective version is for
// synchronous saves without a store and must only be used from the thread
// that issues the mesh's other collectives.
//
// Store keys live under "<prefix>/<session>/", where the session number is
// the count of coordinators this rank has made under the prefix (an atomic
// per-rank counter in the store), so ranks that save in the same order agree
// on it without talking. A store shared by runs needs a per-run prefix.
#ifndef FSDPP_CHECKPOINT_COORDINATOR_H_
#define FSDPP_CHECKPOINT_COORDINATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/store.h"
#include "mesh/device_mesh.h"

namespace fsdpp {

class Coordinator {
 public:
  virtual ~Coordinator() = default;
  // This rank and the number of ranks.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank 0 receives every rank's `value` (in rank order); the others get an
  // empty vector. Each tag is used once per coordinator.
  virtual absl::StatusOr<std::vector<std::string>> Gather(
      const std::string& tag, std::string value) = 0;
  // Every rank receives rank 0's `value` (the others' argument is ignored).
  virtual absl::StatusOr<std::string> Broadcast(const std::string& tag,
                                                std::string value) = 0;
};

// A coordinator for a process saving alone (rank 0 of 1).
std::unique_ptr<Coordinator> MakeLocalCoordinator();

// A coordinator over `store` (not owned) for rank `rank` of `size`; every
// wait is bounded by `timeout` and names the ranks that did not answer.
// Rank 0 deletes each session's keys once every rank is known to be done
// with them (at the start of the next session); `broadcast_tags` lists the
// tags whose broadcast keys that covers.
absl::StatusOr<std::unique_ptr<Coordinator>> MakeStoreCoordinator(
    Store* store, const std::string& prefix, int rank, int size,
    absl::Duration timeout, std::vector<std::string> broadcast_tags);

// A coordinator over `mesh`'s flat group (all-gather and broadcast), bounded
// by `timeout`. Calling thread only, in the same order on every rank.
absl::StatusOr<std::unique_ptr<Coordinator>> MakeCollectiveCoordinator(
    DeviceMesh* mesh, absl::Duration timeout);

// Length-prefixed packing of a list of strings into one (for broadcasts).
std::string PackStrings(const std::vector<std::string>& values);
absl::StatusOr<std::vector<std::string>> UnpackStrings(
    const std::string& packed);

}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_COORDINATOR_H_
