// Test helper: runs a function on every rank of a DeviceMesh, ranks as
// threads of this process over real Gloo (loopback TCP) and one in-memory
// store.
#ifndef FSDPP_MESH_RUN_ON_MESH_H_
#define FSDPP_MESH_RUN_ON_MESH_H_

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
// fn(rank, mesh) on each; returns when all ranks finished. Every rank keeps
// its mesh (and so its connections) until all ranks are done: a rank that
// finishes early and closes its sockets would otherwise break a slower rank
// that is still connecting (its Create fails with "connection closed by
// peer") or still talking to it.
inline void RunOnMesh(const std::vector<MeshAxis>& axes,
                      const std::function<void(int, DeviceMesh&)>& fn,
                      absl::Duration timeout = absl::Seconds(60)) {
  int world = 1;
  for (const MeshAxis& a : axes) world *= a.size;
  InMemoryStore store;
  GlooOptions options;
  options.timeout = timeout;
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto mesh =
          DeviceMesh::Create(axes, r, world, GlooGroupFactory(&store, options));
      if (mesh.ok()) {
        fn(r, **mesh);
      } else {
        ADD_FAILURE() << "rank " << r << ": " << mesh.status();
      }
      std::unique_lock<std::mutex> lock(mu);
      ++done;
      cv.notify_all();
      if (!cv.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                       [&] { return done == world; })) {
        ADD_FAILURE() << "rank " << r << ": only " << done << " of " << world
                      << " ranks finished within "
                      << absl::FormatDuration(timeout);
      }
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_MESH_RUN_ON_MESH_H_
