// Test helper: runs a function on every rank of a DeviceMesh, ranks as
// threads of this process over real Gloo (loopback TCP) and one in-memory
// store; a gtest wrapper of mesh/ranks.h's RunOnThreads.
#ifndef FSDPP_MESH_RUN_ON_MESH_H_
#define FSDPP_MESH_RUN_ON_MESH_H_

#include <functional>
#include <vector>

#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "mesh/ranks.h"

namespace fsdpp {
namespace testing_util {

// Builds the mesh `axes` on world = product(sizes) thread ranks and calls
// fn(rank, mesh) on each; returns when all ranks finished (RunOnThreads,
// mesh/ranks.h: every rank keeps its mesh until all are done). A mesh that
// cannot be made, or a rank that does not finish in time, is a test failure.
// `shared_memory`: RanksOptions::shared_memory.
inline void RunOnMesh(const std::vector<MeshAxis>& axes,
                      const std::function<void(int, DeviceMesh&)>& fn,
                      absl::Duration timeout = absl::Seconds(60),
                      bool shared_memory = false) {
  RanksOptions options;
  options.timeout = timeout;
  options.shared_memory = shared_memory;
  const absl::Status status = RunOnThreads(
      axes,
      [&](int rank, DeviceMesh& mesh) {
        fn(rank, mesh);
        return absl::OkStatus();
      },
      options);
  if (!status.ok()) ADD_FAILURE() << status;
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_MESH_RUN_ON_MESH_H_
