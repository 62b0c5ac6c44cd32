// Test helper: `size` ranks as threads of this process, each with a Gloo
// group over one in-memory store (real Gloo, loopback TCP). No rank destroys
// its group before every rank is done (a rank that sends nothing could close
// connections a peer is still opening). The floors above comm use
// mesh/run_on_mesh.h, which builds a whole DeviceMesh the same way.
#ifndef FSDPP_COMM_GLOO_RANKS_H_
#define FSDPP_COMM_GLOO_RANKS_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace testing_util {

// Runs fn(rank, group) on `size` thread ranks; returns when all are done.
// A group that cannot be created fails the current test.
inline void RunGlooRanks(int size,
                         const std::function<void(int, GlooProcessGroup&)>& fn,
                         const std::string& name = "g",
                         GlooOptions options = {}) {
  InMemoryStore store;
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto group = GlooProcessGroup::Create(&store, r, size, name, options);
      if (group.ok()) {
        fn(r, **group);
      } else {
        ADD_FAILURE() << group.status();
      }
      std::unique_lock<std::mutex> lock(mu);
      ++done;
      cv.notify_all();
      cv.wait(lock, [&] { return done == size; });
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_COMM_GLOO_RANKS_H_
