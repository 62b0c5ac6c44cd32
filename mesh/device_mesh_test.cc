// DeviceMesh over real Gloo with thread ranks: coordinates, per-axis groups
// that talk only within their axis, sub-meshes, flat groups, subgroups of
// consecutive ranks on an axis, validation.
#include "mesh/device_mesh.h"

#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "core/logging.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"

namespace fsdpp {
namespace {

constexpr absl::Duration kWait = absl::Seconds(60);

float AllReduceSum(ProcessGroup& group, float value) {
  Buffer b{&value, 1, DType::kF32, Device::Cpu()};
  CHECK_OK((*group.AllReduce(b, ReduceOp::kSum))->Wait(kWait));
  return value;
}

TEST(DeviceMeshTest, TwoDimensionalGroupsStayWithinTheirAxis) {
  // {replicate: 2, shard: 3}: rank = 3 * replicate + shard.
  testing_util::RunOnMesh(
      {{"replicate", 2}, {"shard", 3}}, [](int rank, DeviceMesh& mesh) {
        EXPECT_EQ(mesh.coordinate(), (std::vector<int>{rank / 3, rank % 3}));
        EXPECT_EQ(*mesh.AxisCoordinate("shard"), rank % 3);
        EXPECT_EQ(*mesh.AxisSize("replicate"), 2);
        ProcessGroup* shard = *mesh.Group("shard");
        ProcessGroup* replicate = *mesh.Group("replicate");
        EXPECT_EQ(shard->size(), 3);
        EXPECT_EQ(shard->rank(), rank % 3);
        EXPECT_EQ(replicate->size(), 2);
        EXPECT_EQ(replicate->rank(), rank / 3);
        // Sums of (rank + 1) along each axis: only the axis' ranks contribute.
        const int base = rank / 3 * 3;
        EXPECT_EQ(AllReduceSum(*shard, rank + 1.0f), 3.0f * base + 1 + 2 + 3);
        EXPECT_EQ(AllReduceSum(*replicate, rank + 1.0f),
                  2.0f * (rank % 3 + 1) + 3);
        ProcessGroup* flat = *mesh.FlatGroup();
        EXPECT_EQ(flat->size(), 6);
        EXPECT_EQ(AllReduceSum(*flat, rank + 1.0f), 21.0f);
      });
}

TEST(DeviceMeshTest, SubMeshes) {
  testing_util::RunOnMesh(
      {{"pp", 2}, {"dp", 2}, {"tp", 2}}, [](int rank, DeviceMesh& mesh) {
        DeviceMesh* dp_tp = *mesh.SubMesh({"dp", "tp"});
        EXPECT_EQ(dp_tp->size(), 4);
        EXPECT_EQ(dp_tp->rank(), rank % 4);
        const int pp = rank / 4;
        EXPECT_EQ(dp_tp->ranks(), (std::vector<int>{4 * pp, 4 * pp + 1,
                                                    4 * pp + 2, 4 * pp + 3}));
        EXPECT_EQ(*dp_tp->Group("tp"), *mesh.Group("tp"));  // Shared groups.
        EXPECT_EQ(AllReduceSum(**dp_tp->FlatGroup(), 1.0f), 4.0f);
        DeviceMesh* pp_only = *mesh.SubMesh({"pp"});
        EXPECT_EQ(pp_only->ranks(), (std::vector<int>{rank % 4, rank % 4 + 4}));
        EXPECT_EQ(*mesh.SubMesh({"dp", "tp"}), dp_tp);  // Cached.
        EXPECT_FALSE(mesh.SubMesh({"dp", "dp"}).ok());
      });
}

TEST(DeviceMeshTest, SubgroupsOfConsecutiveRanksOnAnAxis) {
  // {replicate: 2, shard: 4}: shard blocks of 2 are {0,1} {2,3} in replica 0
  // and {4,5} {6,7} in replica 1.
  testing_util::RunOnMesh(
      {{"replicate", 2}, {"shard", 4}}, [](int rank, DeviceMesh& mesh) {
        absl::StatusOr<ProcessGroup*> pair = mesh.Subgroup("shard", 2);
        ASSERT_TRUE(pair.ok()) << pair.status();
        EXPECT_EQ((*pair)->size(), 2);
        EXPECT_EQ((*pair)->rank(), rank % 2);
        const int first = rank / 2 * 2;
        EXPECT_EQ((*pair)->name(),
                  absl::StrCat("mesh/shard[", first % 4, "..", first % 4 + 1,
                               "]@replicate=", rank / 4));
        // Only the block's two ranks contribute.
        EXPECT_EQ(AllReduceSum(**pair, rank + 1.0f), 2.0f * first + 3);
        EXPECT_EQ(*mesh.Subgroup("shard", 2), *pair);  // Cached.
        // Groups of 1 are this rank alone; the whole axis is the axis group.
        ProcessGroup* single = *mesh.Subgroup("shard", 1);
        EXPECT_EQ(single->size(), 1);
        EXPECT_EQ(AllReduceSum(*single, rank + 1.0f), rank + 1.0f);
        EXPECT_EQ(*mesh.Subgroup("shard", 4), *mesh.Group("shard"));
        EXPECT_EQ(*mesh.Subgroup("replicate", 2), *mesh.Group("replicate"));
        // The pair still works after other groups were used.
        EXPECT_EQ(AllReduceSum(**pair, 1.0f), 2.0f);
        absl::StatusOr<ProcessGroup*> bad = mesh.Subgroup("shard", 3);
        ASSERT_FALSE(bad.ok());
        EXPECT_EQ(bad.status().message(),
                  "mesh 'mesh' {replicate: 2, shard: 4}: a subgroup of 3 "
                  "ranks does not divide axis 'shard' of size 4");
        EXPECT_FALSE(mesh.Subgroup("shard", 0).ok());
        EXPECT_FALSE(mesh.Subgroup("tp", 2).ok());
      });
}

TEST(DeviceMeshTest, ReshapedMeshKeepsEachRanksPlace) {
  // {replicate: 2, shard: 4} as {replicate: 2, efsdp: 2, ep: 2}: shard
  // coordinate c is (efsdp, ep) = (c / 2, c % 2); ep groups are the shard
  // axis' consecutive pairs, efsdp groups its strided ones.
  testing_util::RunOnMesh(
      {{"replicate", 2}, {"shard", 4}}, [](int rank, DeviceMesh& mesh) {
        absl::StatusOr<std::unique_ptr<DeviceMesh>> experts = mesh.Reshape(
            {{"replicate", 2}, {"efsdp", 2}, {"ep", 2}}, "experts");
        ASSERT_TRUE(experts.ok()) << experts.status();
        const int c = rank % 4;
        EXPECT_EQ((*experts)->coordinate(),
                  (std::vector<int>{rank / 4, c / 2, c % 2}));
        EXPECT_EQ((*experts)->name(), "experts");
        const int base = rank / 4 * 4;
        // ep: {base + 2 (c / 2), + 1}; efsdp: {base + c % 2, + 2}.
        EXPECT_EQ(AllReduceSum(**(*experts)->Group("ep"), rank + 1.0f),
                  2.0f * (base + c / 2 * 2) + 3);
        EXPECT_EQ(AllReduceSum(**(*experts)->Group("efsdp"), rank + 1.0f),
                  2.0f * (base + c % 2) + 4);
        EXPECT_FALSE(mesh.Reshape({{"a", 3}}, "bad").ok());
        DeviceMesh* shard = *mesh.SubMesh({"shard"});
        EXPECT_EQ(shard->Reshape({{"a", 4}}, "sub").status().code(),
                  absl::StatusCode::kFailedPrecondition);
      });
}

TEST(DeviceMeshTest, ValidationErrors) {
  auto never = [](const std::string&, int,
                  int) -> absl::StatusOr<std::unique_ptr<ProcessGroup>> {
    return absl::InternalError("must not be called");
  };
  auto bad = DeviceMesh::Create({{"replicate", 2}, {"shard", 4}}, 0, 6, never);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "mesh 'mesh' {replicate: 2, shard: 4} has 8 ranks but the world "
            "size is 6");
  bad = DeviceMesh::Create({{"a", 2}, {"a", 3}}, 0, 6, never);
  EXPECT_NE(
      bad.status().message().find("axis names must be non-empty and unique"),
      absl::string_view::npos);
  bad = DeviceMesh::Create({{"a", 0}}, 0, 0, never);
  EXPECT_NE(bad.status().message().find("axis 'a' has size 0"),
            absl::string_view::npos);
  bad = DeviceMesh::Create({}, 0, 1, never);
  EXPECT_FALSE(bad.ok());
  testing_util::RunOnMesh({{"shard", 2}}, [](int, DeviceMesh& mesh) {
    absl::StatusOr<ProcessGroup*> g = mesh.Group("replicate");
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().message(),
              "mesh 'mesh' {shard: 2} has no axis 'replicate'");
    EXPECT_EQ(mesh.ToString(), "mesh{shard: 2}");
  });
}

}  // namespace
}  // namespace fsdpp
