// Starting ranks: a function run on every rank of a DeviceMesh, either as
// threads of this process (over real Gloo on loopback TCP and one in-memory
// store: try a multi-rank program, or test one, without a launcher) or as
// this process being one rank of a launched job (tools/launch, torchrun,
// OpenMPI or Slurm: the world and the store from the environment). The same
// function runs either way:
//
//   absl::Status Train(int rank, fsdpp::DeviceMesh& mesh) { ... }
//   fsdpp::RunOnThreads({{"dp", 2}}, Train);        // 2 threads
//   fsdpp::RunAsLaunchedRank({{"dp", -1}}, Train);  // under the launcher
//
// Both keep every rank's mesh (and so its connections) until all ranks have
// returned: a rank that finishes early and closes its sockets would break a
// slower one still connecting or talking to it. Every wait is bounded.
#ifndef FSDPP_MESH_RANKS_H_
#define FSDPP_MESH_RANKS_H_

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "mesh/device_mesh.h"

namespace fsdpp {

// What a rank runs: its rank in the world and its mesh.
using RankFunction = std::function<absl::Status(int rank, DeviceMesh& mesh)>;

struct RanksOptions {
  // Bound of the collectives' waits, the store's and the final barrier's.
  absl::Duration timeout = absl::Minutes(1);
  // Gloo groups move all-gathers and reduce-scatters through shared memory
  // (GlooOptions::shared_memory: the ranks share this host).
  bool shared_memory = false;
};

// Runs fn on world = product(axis sizes) thread ranks, each with its mesh
// of `axes`. OK when every rank returned OK; otherwise the lowest failing
// rank's error, prefixed "rank R: " (also when its mesh could not be made),
// or DeadlineExceeded when some rank did not finish within the timeout
// after the first one did.
absl::Status RunOnThreads(const std::vector<MeshAxis>& axes,
                          const RankFunction& fn,
                          const RanksOptions& options = {});

// Runs fn as this process's rank of a launched job: rank, world size and
// the store's address from the launcher's environment (comm/rendezvous.h),
// the mesh of `axes` over Gloo (an axis of size -1 takes what the world
// size leaves), then a barrier over the world before the mesh goes.
// NotFound without a launcher's environment, InvalidArgument for a broken
// one or axes that do not multiply to the world size; fn's error, prefixed
// "rank R: ".
absl::Status RunAsLaunchedRank(std::vector<MeshAxis> axes,
                               const RankFunction& fn,
                               const RanksOptions& options = {});

}  // namespace fsdpp

#endif  // FSDPP_MESH_RANKS_H_
