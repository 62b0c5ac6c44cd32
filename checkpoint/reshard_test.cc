// The reshard matrix: checkpoints saved by 1, 2, 3 and 4 ranks (FSDP,
// Shard(0) on a 1-D mesh) and by a 2x2 mesh with 2-D and HSDP layouts are
// loaded at 1, 2, 3 and 4 ranks (Shard(0)) and on an HSDP mesh {replicate: 2,
// shard: 2} with [Replicate, Shard(0)]. Every rank checks its shard, and the
// full tensors gathered with DTensor::FullTensor are bitwise equal to the
// originals. Shapes are uneven ([7, 5], [13], [2, 3] with empty shards, ...)
// and the CRC blocks are tiny (16 or 32 bytes), so partial block reads at every
// alignment are exercised; one save uses the default 1 MiB blocks.
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/test_checkpoints.h"
#include "comm/store.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "tensor/dtensor.h"

namespace fsdpp {
namespace {

using testing_util::BitPattern;
using testing_util::BitwiseEqual;
using testing_util::BoxOn;
using testing_util::FreshDir;
using testing_util::MakeDTensor;
using testing_util::RunOnMesh;
using testing_util::Slice;
using testing_util::ZerosLike;

const Placement S0 = Placement::Shard(0);
const Placement S1 = Placement::Shard(1);
const Placement R = Placement::Replicate();

struct Spec {
  std::string key;
  Shape shape;
  DType dtype;
};

const std::vector<Spec>& Specs() {
  static const std::vector<Spec> specs = {
      {"layers.0.w", {7, 5}, DType::kF32}, {"layers.0.b", {13}, DType::kBF16},
      {"emb", {2, 3}, DType::kI64},        {"cube", {5, 3, 4}, DType::kF16},
      {"opt.m", {9, 2}, DType::kF32},      {"wide", {3, 70}, DType::kF32},
  };
  return specs;
}

Tensor Reference(const Spec& spec) {
  return BitPattern(spec.shape, spec.dtype, std::hash<std::string>()(spec.key));
}

// A mesh and the placements every tensor gets on it (per key).
struct Layout {
  std::string name;
  std::vector<MeshAxis> axes;
  std::vector<Placement> (*placements)(const std::string& key);
};

std::vector<Placement> Fsdp(const std::string&) { return {S0}; }
std::vector<Placement> Hsdp(const std::string&) { return {R, S0}; }
// Save-side 2-D layouts: a mix of 2-D sharding, columns and HSDP.
std::vector<Placement> Mixed2d(const std::string& key) {
  if (key == "layers.0.w" || key == "wide") return {S0, S1};
  if (key == "cube") return {S1, R};
  if (key == "opt.m") return {R, S1};
  return {R, S0};
}

std::vector<Layout> LoadLayouts() {
  std::vector<Layout> layouts;
  for (int w = 1; w <= 4; ++w) {
    layouts.push_back({absl::StrCat("fsdp", w), {{"dp", w}}, &Fsdp});
  }
  layouts.push_back({"hsdp2x2", {{"replicate", 2}, {"shard", 2}}, &Hsdp});
  return layouts;
}

void SaveWith(const Layout& layout, const std::string& root,
              uint64_t block_bytes, bool use_store) {
  InMemoryStore store;
  RunOnMesh(layout.axes, [&](int, DeviceMesh& mesh) {
    StateDict state;
    for (const Spec& spec : Specs()) {
      ASSERT_TRUE(
          state
              .AddDTensor(spec.key, MakeDTensor(Reference(spec), &mesh,
                                                layout.placements(spec.key)))
              .ok());
    }
    ASSERT_TRUE(state.AddTensor("count", BitPattern({}, DType::kI64, 9)).ok());
    ASSERT_TRUE(state.AddBytes("loader", "epoch=3;offset=1234").ok());
    SaveOptions options;
    options.mesh = &mesh;
    options.store = use_store ? &store : nullptr;
    options.block_bytes = block_bytes;
    absl::StatusOr<SaveResult> saved = Save(state, root, 10, options);
    ASSERT_TRUE(saved.ok()) << layout.name << ": " << saved.status();
  });
}

void LoadAndCheck(const Layout& layout, const std::string& dir,
                  const std::string& saved_by) {
  RunOnMesh(layout.axes, [&](int, DeviceMesh& mesh) {
    StateDict state;
    for (const Spec& spec : Specs()) {
      ASSERT_TRUE(
          state
              .AddDTensor(spec.key,
                          MakeDTensor(ZerosLike(spec.shape, spec.dtype), &mesh,
                                      layout.placements(spec.key)))
              .ok());
    }
    ASSERT_TRUE(state.AddTensor("count", ZerosLike({}, DType::kI64)).ok());
    ASSERT_TRUE(state.AddBytes("loader", "").ok());
    absl::StatusOr<LoadResult> loaded = Load(&state, dir);
    ASSERT_TRUE(loaded.ok())
        << saved_by << " -> " << layout.name << ": " << loaded.status();
    for (const Spec& spec : Specs()) {
      const DTensor& t = state.Find(spec.key)->dtensor;
      const Tensor full = Reference(spec);
      EXPECT_TRUE(BitwiseEqual(
          t.local(),
          Slice(full, BoxOn(spec.shape, mesh, layout.placements(spec.key)))))
          << saved_by << " -> " << layout.name << ": " << spec.key
          << " on rank " << mesh.rank();
      absl::StatusOr<Tensor> gathered = t.FullTensor(absl::Seconds(30));
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      EXPECT_TRUE(BitwiseEqual(*gathered, full))
          << saved_by << " -> " << layout.name << ": full " << spec.key;
    }
    EXPECT_TRUE(BitwiseEqual(state.Find("count")->tensor,
                             BitPattern({}, DType::kI64, 9)));
    EXPECT_EQ(*state.bytes("loader"), "epoch=3;offset=1234");
  });
}

class ReshardTest : public ::testing::TestWithParam<int> {};

// Parameter: the saving layout (0-3: FSDP at 1-4 ranks, 4: 2x2 mixed).
TEST_P(ReshardTest, EveryLoadLayoutSeesTheSameTensors) {
  const int index = GetParam();
  const Layout save =
      index < 4
          ? Layout{absl::StrCat("fsdp", index + 1), {{"dp", index + 1}}, &Fsdp}
          : Layout{"mixed2x2", {{"replicate", 2}, {"shard", 2}}, &Mixed2d};
  const std::string root = FreshDir(absl::StrCat("reshard_", save.name));
  // Alternate coordination paths and block sizes across the saves.
  SaveWith(save, root, index == 1 ? kDefaultBlockBytes : (index == 3 ? 32 : 16),
           /*use_store=*/index % 2 == 0);
  for (const Layout& load : LoadLayouts()) {
    LoadAndCheck(load, root + "/step-10", save.name);
  }
}

INSTANTIATE_TEST_SUITE_P(SavedBy, ReshardTest, ::testing::Range(0, 5),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param < 4
                                      ? absl::StrCat("Fsdp", info.param + 1)
                                      : std::string("Mixed2x2");
                         });

// Tensor parallelism's views: a [12, 5] tensor saved row-sharded over 3
// ranks loads as its [3, 4, 5] view split on dim 1 over a [tp 2, dp 2] mesh
// (each rank's rows of each block), and that view saved so loads back as
// [12, 5] over 4 ranks and whole on one; the same for a vector [12] <->
// [3, 4]. A split that is not one of the entry's dims is still refused.
TEST(ReshardViewsTest, SplitAndMergedDimsLoadBothWays) {
  struct Case {
    Shape coarse, fine;
  };
  for (const Case& c : {Case{{12, 5}, {3, 4, 5}}, Case{{12}, {3, 4}}}) {
    const Tensor coarse = BitPattern(c.coarse, DType::kF32, 11);
    const Tensor fine = *coarse.Reshape(c.fine);
    const std::string a = FreshDir("views_coarse"), b = FreshDir("views_fine");
    RunOnMesh({{"dp", 3}}, [&](int, DeviceMesh& mesh) {
      StateDict state;
      ASSERT_TRUE(state.AddDTensor("w", MakeDTensor(coarse, &mesh, {S0})).ok());
      SaveOptions options;
      options.mesh = &mesh;
      ASSERT_TRUE(Save(state, a, 1, options).ok());
    });
    RunOnMesh({{"tp", 2}, {"dp", 2}}, [&](int, DeviceMesh& mesh) {
      StateDict state;
      ASSERT_TRUE(
          state
              .AddDTensor("w", MakeDTensor(ZerosLike(c.fine, DType::kF32),
                                           &mesh, {S1, S1}))
              .ok());
      absl::StatusOr<LoadResult> loaded = Load(&state, a + "/step-1");
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      EXPECT_TRUE(BitwiseEqual(state.Find("w")->dtensor.local(),
                               Slice(fine, BoxOn(c.fine, mesh, {S1, S1}))));
      SaveOptions options;
      options.mesh = &mesh;
      ASSERT_TRUE(Save(state, b, 1, options).ok());
    });
    for (int w : {4, 1}) {
      RunOnMesh({{"dp", w}}, [&](int, DeviceMesh& mesh) {
        StateDict state;
        ASSERT_TRUE(
            state
                .AddDTensor("w", MakeDTensor(ZerosLike(c.coarse, DType::kF32),
                                             &mesh, {S0}))
                .ok());
        absl::StatusOr<LoadResult> loaded = Load(&state, b + "/step-1");
        ASSERT_TRUE(loaded.ok()) << loaded.status();
        EXPECT_TRUE(BitwiseEqual(state.Find("w")->dtensor.local(),
                                 Slice(coarse, BoxOn(c.coarse, mesh, {S0}))))
            << "W=" << w;
      });
    }
  }
  // [12, 5] is not [5, 12] split.
  const std::string dir = FreshDir("views_bad");
  StateDict saved;
  ASSERT_TRUE(saved.AddTensor("w", BitPattern({12, 5}, DType::kF32, 1)).ok());
  ASSERT_TRUE(Save(saved, dir, 1, SaveOptions()).ok());
  RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    StateDict state;
    ASSERT_TRUE(
        state
            .AddDTensor("w", MakeDTensor(ZerosLike({5, 3, 4}, DType::kF32),
                                         &mesh, {S0}))
            .ok());
    absl::Status s = Load(&state, dir + "/step-1").status();
    EXPECT_TRUE(absl::StrContains(s.message(), "shape mismatch")) << s;
  });
}

// A resharded load reads only the blocks covering each rank's rows.
TEST(ReshardReadsTest, EachRankReadsOnlyItsShare) {
  const std::string root = FreshDir("reshard_bytes");
  const Tensor full = BitPattern({1024, 256}, DType::kF32, 3);  // 1 MiB.
  StateDict saved;
  ASSERT_TRUE(saved.AddTensor("w", full).ok());
  SaveOptions options;
  options.block_bytes = 4096;
  ASSERT_TRUE(Save(saved, root, 1, options).ok());
  RunOnMesh({{"dp", 4}}, [&](int, DeviceMesh& mesh) {
    StateDict state;
    ASSERT_TRUE(
        state
            .AddDTensor("w", MakeDTensor(ZerosLike({1024, 256}, DType::kF32),
                                         &mesh, {S0}))
            .ok());
    absl::StatusOr<LoadResult> loaded = Load(&state, root + "/step-1");
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->bytes_read, full.nbytes() / 4);
    EXPECT_TRUE(BitwiseEqual(state.Find("w")->dtensor.local(),
                             Slice(full, BoxOn({1024, 256}, mesh, {S0}))));
    testing_util::Barrier(mesh);
  });
}

}  // namespace
}  // namespace fsdpp
