// Test helper: runs a function on every rank of a DeviceMesh, ranks as
// threads of this process over real Gloo (loopback TCP) and one in-memory
// store.
#ifndef FSDPP_MESH_TESTING_H_
#define FSDPP_MESH_TESTING_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"

namespace fsdpp {
namespace testing_util {

// Builds the mesh `axes` on world = product(sizes) thread ranks and calls
// fn(rank, mesh) on each; returns when all ranks finished.
inline void RunOnMesh(const std::vector<MeshAxis>& axes,
                      const std::function<void(int, DeviceMesh&)>& fn,
                      absl::Duration timeout = absl::Seconds(60)) {
  int world = 1;
  for (const MeshAxis& a : axes) world *= a.size;
  InMemoryStore store;
  GlooOptions options;
  options.timeout = timeout;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto mesh =
          DeviceMesh::Create(axes, r, world, GlooGroupFactory(&store, options));
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      fn(r, **mesh);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_MESH_TESTING_H_
