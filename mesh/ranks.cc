// Starting ranks; see ranks.h.
#include "mesh/ranks.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/gloo_backend.h"
#include "comm/rendezvous.h"
#include "comm/store.h"
#include "core/status.h"

namespace fsdpp {
namespace {

absl::Status OfRank(int rank, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat("rank ", rank, ": ", status.message()));
}

}  // namespace

absl::Status RunOnThreads(const std::vector<MeshAxis>& axes,
                          const RankFunction& fn, const RanksOptions& options) {
  int world = 1;
  for (const MeshAxis& a : axes) {
    if (a.size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("RunOnThreads: axis '", a.name, "' has size ", a.size,
                       "; thread ranks need sizes >= 1"));
    }
    world *= a.size;
  }
  InMemoryStore store;
  GlooOptions gloo;
  gloo.timeout = options.timeout;
  gloo.shared_memory = options.shared_memory;
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  std::vector<absl::Status> results(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<DeviceMesh>> mesh =
          DeviceMesh::Create(axes, r, world, GlooGroupFactory(&store, gloo));
      absl::Status result = mesh.ok() ? fn(r, **mesh) : mesh.status();
      // The mesh stays until every rank is done (see ranks.h).
      std::unique_lock<std::mutex> lock(mu);
      ++done;
      cv.notify_all();
      if (!cv.wait_for(lock, absl::ToChronoNanoseconds(options.timeout),
                       [&] { return done == world; }) &&
          result.ok()) {
        result = absl::DeadlineExceededError(absl::StrCat(
            "only ", done, " of ", world, " ranks finished within ",
            absl::FormatDuration(options.timeout), " of this one"));
      }
      results[r] = OfRank(r, result);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) FSDPP_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::Status RunAsLaunchedRank(std::vector<MeshAxis> axes,
                               const RankFunction& fn,
                               const RanksOptions& options) {
  FSDPP_ASSIGN_OR_RETURN(RendezvousInfo info, RendezvousFromEnv());
  int known = 1, open = -1;
  for (size_t i = 0; i < axes.size(); ++i) {
    if (axes[i].size == -1 && open < 0) {
      open = static_cast<int>(i);
    } else {
      known *= axes[i].size;
    }
  }
  if (open >= 0 && known > 0 && info.world_size % known == 0) {
    axes[open].size = info.world_size / known;
  }
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Store> store,
                         StoreFromRendezvous(info, options.timeout));
  GlooOptions gloo;
  gloo.timeout = options.timeout;
  gloo.shared_memory = options.shared_memory;
  FSDPP_ASSIGN_OR_RETURN(gloo.hostname, ListenAddress(info));
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceMesh> mesh,
      DeviceMesh::Create(axes, info.rank, info.world_size,
                         GlooGroupFactory(store.get(), gloo)));
  FSDPP_RETURN_IF_ERROR(OfRank(info.rank, fn(info.rank, *mesh)));
  // The mesh stays until every rank is done (see ranks.h).
  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * world, mesh->FlatGroup());
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> barrier, world->Barrier());
  return OfRank(info.rank, barrier->Wait(options.timeout));
}

}  // namespace fsdpp
