// Benchmark helper: the meshes of two thread ranks of this process over real
// Gloo (loopback TCP, one in-memory store), built concurrently (each rank's
// groups connect to the other's), for benchmarks that then step both ranks
// with testing_util::LockStep (comm/lock_step.h).
#ifndef FSDPP_MESH_LOCK_STEP_MESHES_H_
#define FSDPP_MESH_LOCK_STEP_MESHES_H_

#include <array>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "comm/gloo_backend.h"
#include "comm/lock_step.h"
#include "comm/store.h"
#include "core/logging.h"
#include "mesh/device_mesh.h"

namespace fsdpp {
namespace testing_util {

// Rank 0's and rank 1's mesh `axes` (2 ranks in all) over `store`, which
// must outlive them. Aborts with the error if a mesh cannot be built.
inline std::array<std::unique_ptr<DeviceMesh>, 2> LockStepMeshes(
    const std::vector<MeshAxis>& axes, InMemoryStore* store) {
  GlooOptions options;
  options.timeout = absl::Seconds(60);
  std::array<std::unique_ptr<DeviceMesh>, 2> meshes;
  LockStep setup([&](int rank) -> std::shared_ptr<void> {
    auto mesh =
        DeviceMesh::Create(axes, rank, 2, GlooGroupFactory(store, options));
    CHECK_OK(mesh.status());
    meshes[rank] = *std::move(mesh);
    return nullptr;
  });
  setup.Step();
  return meshes;
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_MESH_LOCK_STEP_MESHES_H_
