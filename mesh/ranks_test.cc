// RunOnThreads: every rank runs with its mesh and they talk; a failing rank
// is named; bad axes are refused. RunAsLaunchedRank without a launcher's
// environment says what is missing.
#include "mesh/ranks.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "comm/process_group.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"

namespace fsdpp {
namespace {

TEST(RanksTest, ThreadRanksTalkOverTheirMeshes) {
  std::atomic<int> ran{0};
  const absl::Status status = RunOnThreads(
      {{"dp", 2}, {"tp", 2}}, [&](int rank, DeviceMesh& mesh) -> absl::Status {
        ++ran;
        if (mesh.rank() != rank) {
          return absl::InternalError("the mesh has another rank");
        }
        absl::StatusOr<ProcessGroup*> world = mesh.FlatGroup();
        if (!world.ok()) return world.status();
        float value = static_cast<float>(rank + 1);
        absl::StatusOr<std::shared_ptr<Work>> work = (*world)->AllReduce(
            Buffer{&value, 1, DType::kF32, Device::Cpu()}, ReduceOp::kSum);
        if (!work.ok()) return work.status();
        if (absl::Status s = (*work)->Wait(absl::Seconds(30)); !s.ok()) {
          return s;
        }
        return value == 10.0f ? absl::OkStatus()
                              : absl::InternalError("wrong sum");
      });
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(ran.load(), 4);
}

TEST(RanksTest, TheLowestFailingRankIsNamed) {
  const absl::Status status =
      RunOnThreads({{"dp", 3}}, [](int rank, DeviceMesh&) -> absl::Status {
        if (rank == 0) return absl::OkStatus();
        return absl::DataLossError("disk full");
      });
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_EQ(status.message(), "rank 1: disk full");
  EXPECT_EQ(RunOnThreads({{"dp", 0}},
                         [](int, DeviceMesh&) { return absl::OkStatus(); })
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RanksTest, LaunchedRankTakesTheLaunchersEnvironment) {
  for (const char* var :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
        "SLURM_PROCID", "SLURM_NTASKS"}) {
    unsetenv(var);
  }
  const RankFunction nothing = [](int, DeviceMesh&) {
    return absl::OkStatus();
  };
  absl::Status status = RunAsLaunchedRank({{"dp", -1}}, nothing);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "no launcher environment"))
      << status;
  // One rank of a torchrun-style job: its store served here, the open axis
  // sized from WORLD_SIZE, fn run, the final barrier passed.
  const std::string port = std::to_string(20000 + getpid() % 10000);
  for (const auto& [var, value] :
       std::vector<std::pair<const char*, std::string>>{
           {"RANK", "0"},
           {"WORLD_SIZE", "1"},
           {"LOCAL_RANK", "0"},
           {"LOCAL_WORLD_SIZE", "1"},
           {"MASTER_ADDR", "127.0.0.1"},
           {"MASTER_PORT", port}}) {
    setenv(var, value.c_str(), 1);
  }
  int axis_size = 0;
  status = RunAsLaunchedRank({{"dp", -1}}, [&](int rank, DeviceMesh& mesh) {
    axis_size = mesh.axes()[0].size;
    return rank == 0 ? absl::OkStatus() : absl::InternalError("rank");
  });
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(axis_size, 1);
  status = RunAsLaunchedRank({{"dp", -1}}, [](int, DeviceMesh&) {
    return absl::UnavailableError("no data");
  });
  EXPECT_EQ(status.message(), "rank 0: no data");
}

}  // namespace
}  // namespace fsdpp
