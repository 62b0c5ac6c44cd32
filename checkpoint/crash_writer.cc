// Helper binary of crash_test: saves checkpoints of a ~48 MiB state from two
// thread ranks (Gloo mesh, in-memory store, keep_last = 2) in an endless
// loop, continuing after the newest committed step under ROOT, and prints
// "committed N" after each commit. The test kills it with SIGKILL at chosen
// moments and checks what is left on disk.
//
// Usage: crash_writer ROOT
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/crash_state.h"
#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "core/logging.h"
#include "mesh/device_mesh.h"

namespace fsdpp {
namespace {

int Run(const std::string& root) {
  int64_t step = 1;
  if (absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> listed =
          ListCheckpoints(root);
      listed.ok() && !listed->empty()) {
    step = listed->back().first + 1;
  }
  constexpr int kWorld = 2;
  InMemoryStore store;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      absl::StatusOr<std::unique_ptr<DeviceMesh>> mesh = DeviceMesh::Create(
          {{"dp", kWorld}}, rank, kWorld, GlooGroupFactory(&store, {}));
      CHECK_OK(mesh.status());
      SaveOptions options;
      options.mesh = mesh->get();
      options.store = &store;
      options.keep_last = 2;
      for (int64_t s = step;; ++s) {
        StateDict state = testing_util::crash_state::MakeState(mesh->get(), s);
        absl::StatusOr<SaveResult> saved = Save(state, root, s, options);
        CHECK_OK(saved.status());
        if (rank == 0) {
          std::printf("committed %lld\n", static_cast<long long>(s));
          std::fflush(stdout);
        }
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  return 0;
}

}  // namespace
}  // namespace fsdpp

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s ROOT\n", argv[0]);
    return 2;
  }
  return fsdpp::Run(argv[1]);
}
