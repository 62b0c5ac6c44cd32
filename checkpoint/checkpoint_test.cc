// Save / Load over thread ranks on real Gloo: bitwise round trips of DTensors
// (Shard, Replicate, 2-D and nested layouts), plain tensors and byte values;
// replicated values written once and spread over ranks; asynchronous saves
// that stage, overlap collectives and keep their snapshot; retention, stale
// directory cleanup and re-saving a step; strict and partial loads; errors
// that reach every rank.
#include "checkpoint/checkpoint.h"

#include <atomic>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/metadata.h"
#include "checkpoint/test_checkpoints.h"
#include "comm/store.h"
#include "formats/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "tensor/dtensor.h"

namespace fsdpp {
namespace {

using ::testing::HasSubstr;
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

struct DSpec {
  std::string key;
  Shape shape;
  DType dtype;
  std::vector<Placement> placements;
};

// The 2x2-mesh layouts of the round-trip test.
std::vector<DSpec> MeshSpecs() {
  return {
      {"fsdp.w", {7, 5}, DType::kF32, {R, S0}},  // HSDP.
      {"tp.w", {5, 7}, DType::kF32, {S0, S1}},   // 2-D.
      {"rep.b", {3, 3}, DType::kBF16, {R, R}},   // Replicated.
      {"col", {4, 9}, DType::kF16, {R, S1}},     // Columns.
      {"opt.m", {7, 5}, DType::kF32, {S0, R}},   // Other axis.
      {"emb", {2, 3}, DType::kI32, {S0, S0}},    // Nested, some empty.
      {"scalar", {}, DType::kF32, {R, R}},       // 0-dim.
      {"wide", {1, 300}, DType::kI64, {R, S1}},  // Many blocks.
  };
}

Tensor Reference(const DSpec& spec, int salt = 0) {
  return BitPattern(spec.shape, spec.dtype,
                    std::hash<std::string>()(spec.key) + salt);
}

// Builds the round-trip state on `mesh`: DTensors from `specs` (zeros when
// `zeros`), plain tensors and byte values.
StateDict MakeState(DeviceMesh* mesh, const std::vector<DSpec>& specs,
                    bool zeros) {
  StateDict state;
  for (const DSpec& spec : specs) {
    const Tensor full =
        zeros ? ZerosLike(spec.shape, spec.dtype) : Reference(spec);
    CHECK_OK(
        state.AddDTensor(spec.key, MakeDTensor(full, mesh, spec.placements)));
  }
  auto plain = [&](const std::string& key, Shape shape, DType dtype) {
    CHECK_OK(state.AddTensor(
        key, zeros ? ZerosLike(shape, dtype)
                   : BitPattern(shape, dtype, std::hash<std::string>()(key))));
  };
  plain("plain.f32", {6}, DType::kF32);
  plain("plain.u8", {5, 2}, DType::kU8);
  plain("opt.step", {}, DType::kI64);
  const int rank = mesh->rank();
  CHECK_OK(state.AddBytes("step", zeros ? "" : "42"));
  CHECK_OK(state.AddBytes("config", zeros ? "" : R"({"lr": 3e-4})"));
  CHECK_OK(state.AddBytes("empty", ""));
  CHECK_OK(state.AddBytes(
      absl::StrCat("rng/rank", rank),
      zeros ? "" : std::string("\0\1rng", 5) + std::to_string(rank * 7919)));
  return state;
}

void ExpectStateMatches(const StateDict& state, DeviceMesh* mesh,
                        const std::vector<DSpec>& specs) {
  for (const DSpec& spec : specs) {
    const StateDict::Item* item = state.Find(spec.key);
    ASSERT_NE(item, nullptr) << spec.key;
    const Tensor expected =
        Slice(Reference(spec), BoxOn(spec.shape, *mesh, spec.placements));
    EXPECT_TRUE(BitwiseEqual(item->dtensor.local(), expected))
        << spec.key << " on rank " << mesh->rank();
  }
  for (const char* key : {"plain.f32", "plain.u8", "opt.step"}) {
    const Tensor& t = state.Find(key)->tensor;
    EXPECT_TRUE(BitwiseEqual(
        t, BitPattern(t.shape(), t.dtype(), std::hash<std::string>()(key))))
        << key;
  }
  EXPECT_EQ(*state.bytes("step"), "42");
  EXPECT_EQ(*state.bytes("config"), R"({"lr": 3e-4})");
  EXPECT_EQ(*state.bytes("empty"), "");
  EXPECT_EQ(*state.bytes(absl::StrCat("rng/rank", mesh->rank())),
            std::string("\0\1rng", 5) + std::to_string(mesh->rank() * 7919));
}

TEST(CheckpointTest, RoundTripIsBitwiseAndReplicasAreWrittenOnce) {
  const std::string root = FreshDir("roundtrip");
  InMemoryStore store;
  const std::vector<DSpec> specs = MeshSpecs();
  RunOnMesh({{"replicate", 2}, {"shard", 2}}, [&](int, DeviceMesh& mesh) {
    StateDict state = MakeState(&mesh, specs, /*zeros=*/false);
    SaveOptions options;
    options.mesh = &mesh;
    options.store = &store;
    options.block_bytes = 16;  // Many blocks: exercises partial reads.
    absl::StatusOr<SaveResult> saved = Save(state, root, 3, options);
    ASSERT_TRUE(saved.ok()) << saved.status();
    EXPECT_EQ(saved->path, root + "/step-3");

    StateDict loaded = MakeState(&mesh, specs, /*zeros=*/true);
    // Strict: the other ranks' RNG states are unexpected keys...
    absl::StatusOr<LoadResult> result = Load(&loaded, saved->path);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(result.status().message(), HasSubstr("'rng/rank"));
    // ...unless declared optional.
    LoadOptions options_with_rng;
    options_with_rng.optional_prefixes = {"rng/"};
    result = Load(&loaded, saved->path, options_with_rng);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->step, 3);
    EXPECT_EQ(result->unexpected_keys.size(), 3u);
    EXPECT_GT(result->bytes_read, 0u);
    ExpectStateMatches(loaded, &mesh, specs);
  });

  // Every element is stored exactly once; replicated values are spread.
  absl::StatusOr<CheckpointMetadata> metadata = ReadMetadata(root + "/step-3");
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  EXPECT_EQ(metadata->world_size, 4);
  uint64_t expected_bytes = 0;
  for (const auto& [key, entry] : metadata->entries) {
    expected_bytes += entry.nbytes();
  }
  EXPECT_EQ(metadata->TotalBytes(), expected_bytes);
  std::set<int64_t> replica_writers;
  for (const char* key : {"rep.b", "scalar", "plain.f32", "plain.u8",
                          "opt.step", "step", "config"}) {
    const EntryMetadata& entry = metadata->entries.at(key);
    ASSERT_EQ(entry.chunks.size(), 1u) << key;
    replica_writers.insert(entry.chunks[0].file);
  }
  EXPECT_GE(replica_writers.size(), 2u);
  EXPECT_TRUE(metadata->entries.at("empty").chunks.empty());
  EXPECT_EQ(metadata->entries.at("rng/rank3").kind, EntryKind::kBytes);
  EXPECT_EQ(metadata->entries.at("emb").chunks.size(), 2u);
  EXPECT_EQ(metadata->entries.at("tp.w").chunks.size(), 4u);
}

TEST(CheckpointTest, SynchronousSaveOverCollectivesWithoutAStore) {
  const std::string root = FreshDir("collectives");
  const DSpec spec{"w", {7, 5}, DType::kF32, {S0}};
  RunOnMesh({{"dp", 3}}, [&](int, DeviceMesh& mesh) {
    StateDict state;
    ASSERT_TRUE(
        state.AddDTensor("w", MakeDTensor(Reference(spec), &mesh, {S0})).ok());
    ASSERT_TRUE(state.AddBytes("step", "7").ok());
    SaveOptions options;
    options.mesh = &mesh;
    for (int step = 1; step <= 2; ++step) {
      absl::StatusOr<SaveResult> saved = Save(state, root, step, options);
      ASSERT_TRUE(saved.ok()) << saved.status();
      EXPECT_EQ(saved->total_bytes, 7u * 5 * 4 + 1);
    }
    StateDict loaded;
    ASSERT_TRUE(loaded
                    .AddDTensor("w", MakeDTensor(ZerosLike({7, 5}, DType::kF32),
                                                 &mesh, {S0}))
                    .ok());
    ASSERT_TRUE(loaded.AddBytes("step", "").ok());
    ASSERT_TRUE(Load(&loaded, root + "/step-2").ok());
    EXPECT_TRUE(
        BitwiseEqual(loaded.Find("w")->dtensor.local(),
                     Slice(Reference(spec), BoxOn({7, 5}, mesh, {S0}))));
    EXPECT_EQ(*loaded.bytes("step"), "7");
  });
}

TEST(CheckpointTest, AsyncSaveKeepsItsSnapshotWhileTrainingRuns) {
  const std::string root = FreshDir("async");
  InMemoryStore store;
  const Tensor full = BitPattern({256, 1024}, DType::kF32, 5);  // 1 MiB.
  RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    DTensor w = MakeDTensor(full, &mesh, {S0});
    StateDict state;
    ASSERT_TRUE(state.AddDTensor("w", w).ok());
    SaveOptions options;
    options.mesh = &mesh;
    options.store = &store;
    options.keep_last = 2;
    options.block_bytes = 4096;
    absl::StatusOr<std::unique_ptr<AsyncSaver>> saver =
        AsyncSaver::Create(root, options);
    ASSERT_TRUE(saver.ok()) << saver.status();

    absl::StatusOr<std::shared_ptr<PendingSave>> first =
        (*saver)->Save(state, 1);
    ASSERT_TRUE(first.ok()) << first.status();
    // Training goes on: the parameters change and collectives run on the
    // mesh while the save is written.
    std::memset(w.mutable_local()->raw_data(), 0xAB, w.local().nbytes());
    ProcessGroup* group = *mesh.Group("dp");
    for (int i = 0; i < 20; ++i) {
      float x = 1.0f;
      auto work = group->AllReduce(Buffer{&x, 1, DType::kF32, Device::Cpu()},
                                   ReduceOp::kSum);
      ASSERT_TRUE(work.ok());
      ASSERT_TRUE((*work)->Wait().ok());
      EXPECT_EQ(x, 2.0f);
    }
    absl::StatusOr<SaveResult> result = (*first)->Wait();
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_TRUE((*first)->IsDone());
    EXPECT_LE(result->blocking_time, result->total_time);
    EXPECT_EQ(result->blocking_time, (*first)->blocking_time());

    // Step 1 holds the values from before the overwrite.
    auto load_step = [&](int step) {
      StateDict loaded;
      CHECK_OK(loaded.AddDTensor(
          "w", MakeDTensor(ZerosLike(full.shape(), DType::kF32), &mesh, {S0})));
      CHECK_OK(Load(&loaded, absl::StrCat(root, "/step-", step)).status());
      return loaded.Find("w")->dtensor.local();
    };
    EXPECT_TRUE(BitwiseEqual(load_step(1),
                             Slice(full, BoxOn(full.shape(), mesh, {S0}))));

    // The next saves wait for their predecessor; keep_last = 2 keeps 2 and 3.
    for (int step = 2; step <= 3; ++step) {
      absl::StatusOr<std::shared_ptr<PendingSave>> next =
          (*saver)->Save(state, step);
      ASSERT_TRUE(next.ok()) << next.status();
    }
    ASSERT_TRUE((*saver)->Wait().ok());
    Tensor changed = *Tensor::Empty(full.shape(), DType::kF32, Device::Cpu());
    std::memset(changed.raw_data(), 0xAB, changed.nbytes());
    EXPECT_TRUE(BitwiseEqual(load_step(3),
                             Slice(changed, BoxOn(full.shape(), mesh, {S0}))));
  });
  absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> listed =
      ListCheckpoints(root);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].first, 2);
  EXPECT_EQ((*listed)[1].first, 3);
}

TEST(CheckpointTest, AsyncSnapshotIsTakenBeforeSaveReturns) {
  const std::string root = FreshDir("async_snapshot");
  InMemoryStore store;
  const Tensor full = BitPattern({64, 512}, DType::kBF16, 6);
  RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    DTensor w = MakeDTensor(full, &mesh, {S0});
    StateDict state;
    ASSERT_TRUE(state.AddDTensor("w", w).ok());
    ASSERT_TRUE(state.AddBytes("step", "1").ok());
    SaveOptions options;
    options.mesh = &mesh;
    options.store = &store;
    auto saver = AsyncSaver::Create(root, options);
    ASSERT_TRUE(saver.ok());
    auto pending = (*saver)->Save(state, 1);
    ASSERT_TRUE(pending.ok()) << pending.status();
    std::memset(w.mutable_local()->raw_data(), 0, w.local().nbytes());
    ASSERT_TRUE(state.SetBytes("step", "2").ok());
    ASSERT_TRUE((*pending)->Wait().ok());

    StateDict loaded;
    ASSERT_TRUE(
        loaded
            .AddDTensor("w", MakeDTensor(ZerosLike({64, 512}, DType::kBF16),
                                         &mesh, {S0}))
            .ok());
    ASSERT_TRUE(loaded.AddBytes("step", "").ok());
    ASSERT_TRUE(Load(&loaded, root + "/step-1").ok());
    EXPECT_TRUE(BitwiseEqual(loaded.Find("w")->dtensor.local(),
                             Slice(full, BoxOn({64, 512}, mesh, {S0}))));
    EXPECT_EQ(*loaded.bytes("step"), "1");
  });
}

TEST(CheckpointTest, AsyncSaveOverSeveralRanksNeedsAStore) {
  // One directory made before the ranks start: ranks that each made it
  // afresh would remove it under one another.
  const std::string dir = FreshDir("async_nostore");
  RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    SaveOptions options;
    options.mesh = &mesh;
    auto saver = AsyncSaver::Create(dir, options);
    EXPECT_EQ(saver.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(saver.status().message(), HasSubstr("store"));
    testing_util::Barrier(mesh);
  });
}

StateDict OneTensorState(const Tensor& t) {
  StateDict state;
  CHECK_OK(state.AddTensor("w", t));
  return state;
}

TEST(CheckpointTest, RetentionStaleDirectoriesAndResavingAStep) {
  const std::string root = FreshDir("retention");
  SaveOptions options;
  options.keep_last = 2;
  for (int step = 1; step <= 5; ++step) {
    const Tensor t = BitPattern({3, 4}, DType::kF32, step);
    ASSERT_TRUE(Save(OneTensorState(t), root, step, options).ok());
  }
  auto listed = ListCheckpoints(root);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].first, 4);
  EXPECT_EQ((*listed)[1].first, 5);
  // The dropped ones are deleted in the background; once that is done,
  // nothing else is left.
  ASSERT_TRUE(WaitForCheckpointCleanup().ok());
  EXPECT_EQ(*ListDir(root), (std::vector<std::string>{"step-4", "step-5"}));

  // Leftovers of crashes: a temporary directory, a trash directory and an
  // uncommitted step directory (no metadata) are ignored, the dot ones
  // removed by the next save.
  ASSERT_TRUE(MakeDirs(root + "/.step-9.tmp").ok());
  ASSERT_TRUE(WriteFileDurably(root + "/.step-9.tmp/rank-0.data", "junk").ok());
  ASSERT_TRUE(MakeDirs(root + "/.step-2.trash").ok());
  ASSERT_TRUE(MakeDirs(root + "/step-8").ok());
  EXPECT_EQ(*LatestCheckpoint(root), root + "/step-5");
  ASSERT_TRUE(
      Save(OneTensorState(BitPattern({3, 4}, DType::kF32, 6)), root, 6, options)
          .ok());
  EXPECT_FALSE(PathExists(root + "/.step-9.tmp"));
  EXPECT_FALSE(PathExists(root + "/.step-2.trash"));
  EXPECT_EQ(*LatestCheckpoint(root), root + "/step-6");

  // Re-saving step 6 replaces it atomically.
  const Tensor replacement = BitPattern({3, 4}, DType::kF32, 66);
  ASSERT_TRUE(Save(OneTensorState(replacement), root, 6, options).ok());
  StateDict loaded = OneTensorState(ZerosLike({3, 4}, DType::kF32));
  ASSERT_TRUE(Load(&loaded, root + "/step-6").ok());
  EXPECT_TRUE(BitwiseEqual(loaded.Find("w")->tensor, replacement));
  ASSERT_TRUE(WaitForCheckpointCleanup().ok());
  absl::StatusOr<std::vector<std::string>> names = ListDir(root);
  ASSERT_TRUE(names.ok());
  for (const std::string& name : *names) {
    EXPECT_TRUE(name == "step-5" || name == "step-6" || name == "step-8")
        << name;
  }
}

TEST(CheckpointTest, StrictLoadNamesKeysShapesAndDTypes) {
  const std::string root = FreshDir("strict");
  StateDict state;
  ASSERT_TRUE(state.AddTensor("w", BitPattern({7, 5}, DType::kF32, 1)).ok());
  ASSERT_TRUE(state.AddTensor("b", BitPattern({5}, DType::kBF16, 2)).ok());
  ASSERT_TRUE(state.AddBytes("step", "9").ok());
  ASSERT_TRUE(Save(state, root, 1).ok());
  const std::string dir = root + "/step-1";

  auto load = [&](StateDict s, LoadOptions options = {}) {
    return Load(&s, dir, options).status();
  };
  {  // Missing key.
    StateDict s;
    ASSERT_TRUE(s.AddTensor("w", ZerosLike({7, 5}, DType::kF32)).ok());
    ASSERT_TRUE(s.AddTensor("b", ZerosLike({5}, DType::kBF16)).ok());
    ASSERT_TRUE(s.AddBytes("step", "").ok());
    ASSERT_TRUE(s.AddTensor("extra", ZerosLike({1}, DType::kF32)).ok());
    const absl::Status status = load(std::move(s));
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(status.message(), HasSubstr("'extra'"));
  }
  {  // Unexpected key.
    StateDict s;
    ASSERT_TRUE(s.AddTensor("w", ZerosLike({7, 5}, DType::kF32)).ok());
    ASSERT_TRUE(s.AddBytes("step", "").ok());
    const absl::Status status = load(std::move(s));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("'b'"));
  }
  {  // Shape mismatch names the key and both shapes.
    StateDict s;
    ASSERT_TRUE(s.AddTensor("w", ZerosLike({7, 6}, DType::kF32)).ok());
    ASSERT_TRUE(s.AddTensor("b", ZerosLike({5}, DType::kBF16)).ok());
    ASSERT_TRUE(s.AddBytes("step", "").ok());
    const absl::Status status = load(std::move(s));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("'w'"));
    EXPECT_THAT(status.message(), HasSubstr("f32[7, 5]"));
    EXPECT_THAT(status.message(), HasSubstr("f32[7, 6]"));
  }
  {  // DType mismatch.
    StateDict s;
    ASSERT_TRUE(s.AddTensor("w", ZerosLike({7, 5}, DType::kF32)).ok());
    ASSERT_TRUE(s.AddTensor("b", ZerosLike({5}, DType::kF32)).ok());
    ASSERT_TRUE(s.AddBytes("step", "").ok());
    const absl::Status status = load(std::move(s));
    EXPECT_THAT(status.message(), HasSubstr("'b': dtype mismatch"));
    EXPECT_THAT(status.message(), HasSubstr("bf16[5]"));
  }
  {  // Kind mismatch.
    StateDict s;
    ASSERT_TRUE(s.AddTensor("w", ZerosLike({7, 5}, DType::kF32)).ok());
    ASSERT_TRUE(s.AddTensor("b", ZerosLike({5}, DType::kBF16)).ok());
    ASSERT_TRUE(s.AddTensor("step", ZerosLike({1}, DType::kU8)).ok());
    EXPECT_THAT(load(std::move(s)).message(), HasSubstr("'step'"));
  }
  {  // Partial load: present keys load, the rest is reported and untouched.
    StateDict s;
    const Tensor untouched = BitPattern({2}, DType::kF32, 3);
    ASSERT_TRUE(s.AddTensor("w", ZerosLike({7, 5}, DType::kF32)).ok());
    ASSERT_TRUE(s.AddTensor("new", untouched).ok());
    LoadOptions options;
    options.strict = false;
    absl::StatusOr<LoadResult> result = Load(&s, dir, options);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->missing_keys, std::vector<std::string>{"new"});
    EXPECT_EQ(result->unexpected_keys, (std::vector<std::string>{"b", "step"}));
    EXPECT_TRUE(
        BitwiseEqual(s.Find("w")->tensor, BitPattern({7, 5}, DType::kF32, 1)));
    EXPECT_TRUE(BitwiseEqual(s.Find("new")->tensor, untouched));
  }
}

TEST(CheckpointTest, InconsistentStateFailsOnEveryRankAndLeavesNoDirectory) {
  for (bool use_store : {true, false}) {
    SCOPED_TRACE(use_store ? "store" : "collectives");
    const std::string root = FreshDir("inconsistent");
    InMemoryStore store;
    std::atomic<int> failures{0};
    RunOnMesh({{"dp", 2}}, [&](int rank, DeviceMesh& mesh) {
      SaveOptions options;
      options.mesh = &mesh;
      options.store = use_store ? &store : nullptr;
      auto expect_error = [&](const StateDict& state,
                              std::vector<std::string> parts) {
        absl::StatusOr<SaveResult> saved = Save(state, root, 1, options);
        ASSERT_FALSE(saved.ok());
        for (const std::string& part : parts) {
          EXPECT_THAT(saved.status().message(), HasSubstr(part));
        }
        ++failures;
      };
      {  // Shapes disagree.
        StateDict state;
        ASSERT_TRUE(
            state.AddTensor("x", ZerosLike({3 + rank}, DType::kF32)).ok());
        expect_error(state, {"'x'", "rank 0 has tensor f32[3]",
                             "rank 1 has tensor f32[4]"});
      }
      {  // A replicated byte value differs.
        StateDict state;
        ASSERT_TRUE(state.AddBytes("seed", std::to_string(rank)).ok());
        expect_error(state, {"'seed'", "per-rank keys"});
      }
      {  // Shards held by one rank only: the boxes do not tile the tensor.
        StateDict state;
        if (rank == 0) {
          ASSERT_TRUE(
              state
                  .AddDTensor("half", MakeDTensor(ZerosLike({4}, DType::kF32),
                                                  &mesh, {S0}))
                  .ok());
        }
        expect_error(state, {"'half'", "cover 2 of the 4"});
      }
      {  // Partial DTensors cannot be saved.
        StateDict state;
        auto partial = DTensor::FromLocal(ZerosLike({2}, DType::kF32), &mesh,
                                          {Placement::Partial()}, {2});
        ASSERT_TRUE(partial.ok());
        ASSERT_TRUE(state.AddDTensor("p", *partial).ok());
        expect_error(state, {"'p'", "Partial"});
      }
      {  // One rank cannot write (its root is unusable).
        StateDict state;
        ASSERT_TRUE(
            state
                .AddDTensor(
                    "w", MakeDTensor(ZerosLike({4}, DType::kF32), &mesh, {S0}))
                .ok());
        const std::string my_root = rank == 1 ? root + "/missing/deeper" : root;
        absl::StatusOr<SaveResult> saved = Save(state, my_root, 1, options);
        ASSERT_FALSE(saved.ok());
        EXPECT_THAT(saved.status().message(), HasSubstr("rank 1: "));
        EXPECT_THAT(saved.status().message(), HasSubstr("rank-1.data"));
        ++failures;
      }
      // The ranks are still in step: a valid save goes through.
      StateDict state;
      ASSERT_TRUE(state.AddBytes("ok", "1").ok());
      EXPECT_TRUE(Save(state, root, 2, options).ok());
    });
    EXPECT_EQ(failures.load(), 10);
    absl::StatusOr<std::vector<std::string>> names = ListDir(root);
    ASSERT_TRUE(names.ok());
    EXPECT_EQ(*names, std::vector<std::string>{"step-2"});
  }
}

// check_finite: a NaN on one rank fails the save on every rank before it
// commits (naming the key); a checkpoint saved without the check is refused
// by a checking load, and read as it is by one that does not check.
TEST(CheckpointTest, NonFiniteValuesAreNeitherCommittedNorLoaded) {
  const std::string root = FreshDir("non_finite");
  InMemoryStore store;
  std::vector<float> values(12, 0.5f);
  values[9] = std::numeric_limits<float>::quiet_NaN();  // rank 1's shard
  const Tensor full = *Tensor::FromFloats({6, 2}, values);
  RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    StateDict state;
    ASSERT_TRUE(
        state.AddDTensor("optim/w.exp_avg", MakeDTensor(full, &mesh, {S0}))
            .ok());
    ASSERT_TRUE(state.AddBytes("train/step", "3").ok());
    SaveOptions options;
    options.mesh = &mesh;
    options.store = &store;
    options.check_finite = true;
    absl::StatusOr<SaveResult> saved = Save(state, root, 3, options);
    ASSERT_FALSE(saved.ok());
    EXPECT_EQ(saved.status().code(), absl::StatusCode::kFailedPrecondition)
        << saved.status();
    EXPECT_THAT(saved.status().message(), HasSubstr("rank 1: "));
    EXPECT_THAT(saved.status().message(), HasSubstr("'optim/w.exp_avg'"));
    EXPECT_THAT(saved.status().message(), HasSubstr("1 non-finite"));
    // Without the check it is saved (as before the check existed).
    options.check_finite = false;
    ASSERT_TRUE(Save(state, root, 4, options).ok());
  });
  absl::StatusOr<std::vector<std::string>> names = ListDir(root);
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"step-4"});
  StateDict whole;
  ASSERT_TRUE(
      whole.AddTensor("optim/w.exp_avg", ZerosLike({6, 2}, DType::kF32)).ok());
  ASSERT_TRUE(whole.AddBytes("train/step", "").ok());
  LoadOptions checking;
  checking.check_finite = true;
  absl::StatusOr<LoadResult> refused = Load(&whole, root + "/step-4", checking);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss)
      << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("'optim/w.exp_avg'"));
  EXPECT_THAT(refused.status().message(), HasSubstr("1 non-finite"));
  EXPECT_TRUE(Load(&whole, root + "/step-4").ok());
}

TEST(CheckpointTest, BadOptionsAreRejected) {
  StateDict state;
  SaveOptions options;
  options.block_bytes = 100;
  EXPECT_EQ(Save(state, FreshDir("bad"), 1, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Save(state, FreshDir("bad"), -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LatestCheckpoint(FreshDir("bad")).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace fsdpp
