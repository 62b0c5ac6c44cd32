// DeviceMesh setup and its flat group on 2 thread ranks of this process over
// real Gloo (loopback TCP): DeviceMesh::Create of a 1-D {dp: 2} or 2-D
// {dp: 2, tp: 1} mesh (connecting one group per axis), its FlatGroup and a
// blocking barrier on it, per iteration; and the barrier alone on a mesh set
// up once. Rank 0 runs on the benchmark's thread, rank 1 on a helper thread
// that mirrors each iteration; both meet at a spin barrier after every step,
// so an iteration takes as long as the slower rank.
//
//   bazel run -c opt //mesh:device_mesh_benchmark
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "comm/gloo_backend.h"
#include "comm/lock_step.h"
#include "comm/process_group.h"
#include "comm/store.h"
#include "core/logging.h"
#include "mesh/device_mesh.h"

namespace fsdpp {
namespace {

constexpr int kWorld = 2;

// The axes of a 2-rank mesh with `ndim` axes (the extra ones of size 1).
std::vector<MeshAxis> Axes(int64_t ndim) {
  std::vector<MeshAxis> axes = {{"dp", kWorld}};
  if (ndim == 2) axes.push_back({"tp", 1});
  return axes;
}

GlooOptions Options() {
  GlooOptions options;
  options.timeout = absl::Seconds(60);
  return options;
}

// A blocking barrier on the mesh's flat group.
void FlatBarrier(DeviceMesh& mesh) {
  absl::StatusOr<ProcessGroup*> flat = mesh.FlatGroup();
  CHECK_OK(flat.status());
  CollectiveOptions options;
  options.async_op = false;
  auto work = (*flat)->Barrier(options);
  CHECK_OK(work.status());
  CHECK_OK((*work)->Wait());
}

// Arg: mesh dims (1: {dp: 2}; 2: {dp: 2, tp: 1}).
void BM_CreateMeshAndBarrier(benchmark::State& state) {
  const std::vector<MeshAxis> axes = Axes(state.range(0));
  InMemoryStore store;
  int64_t meshes_made[kWorld] = {0, 0};  // Each rank's own count.
  testing_util::LockStep ranks([&](int rank) -> std::shared_ptr<void> {
    absl::StatusOr<std::unique_ptr<DeviceMesh>> mesh = DeviceMesh::Create(
        axes, rank, kWorld, GlooGroupFactory(&store, Options()),
        absl::StrCat("mesh", meshes_made[rank]++));
    CHECK_OK(mesh.status());
    FlatBarrier(**mesh);
    // Kept (connections open) until both ranks are done with it.
    return std::shared_ptr<DeviceMesh>(*std::move(mesh));
  });
  for (auto _ : state) ranks.Step();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CreateMeshAndBarrier)->Arg(1)->Arg(2)->UseRealTime();

// Arg: mesh dims, as above. The mesh and flat group are made before timing.
void BM_FlatGroupBarrier(benchmark::State& state) {
  const std::vector<MeshAxis> axes = Axes(state.range(0));
  InMemoryStore store;
  std::unique_ptr<DeviceMesh> meshes[kWorld];
  {
    testing_util::LockStep setup([&](int rank) -> std::shared_ptr<void> {
      auto mesh = DeviceMesh::Create(axes, rank, kWorld,
                                     GlooGroupFactory(&store, Options()));
      CHECK_OK(mesh.status());
      meshes[rank] = *std::move(mesh);
      FlatBarrier(*meshes[rank]);
      return nullptr;
    });
    setup.Step();
  }
  {
    testing_util::LockStep ranks([&](int rank) -> std::shared_ptr<void> {
      FlatBarrier(*meshes[rank]);
      return nullptr;
    });
    for (auto _ : state) ranks.Step();
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FlatGroupBarrier)->Arg(1)->Arg(2)->UseRealTime();

}  // namespace
}  // namespace fsdpp
