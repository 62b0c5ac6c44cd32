// ZeRO++ hpZ (FullyShardOptions::hpz_degree) on thread ranks over real Gloo:
// parity with the unsharded reference at W=4, N=2; the backward all-gathers
// of the resharded units run on the mesh's 2-rank subgroup while the forward
// ones use the whole shard axis; what stays between forward and backward is
// exactly the root's unsharded parameters plus a 1/N piece of each block;
// hpZ changes no number (bf16, bitwise); HSDP, activation checkpointing and
// a last block kept unsharded compose with it; bad degrees are errors.
#include <atomic>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "tests/fsdp_testing.h"

namespace fsdpp {
namespace fsdp {
namespace {

using parity::DebugConfig;
using parity::FsdpRun;
using parity::TrainResult;
using parity::Units;

constexpr int kSteps = 3;

int64_t UnshardedBytes(FsdpUnit* unit, DType dtype) {
  int64_t n = 0;
  for (ShardedParameter& sp : unit->parameters())
    n += NumElements(sp.shape) * static_cast<int64_t>(DTypeSize(dtype));
  return n;
}

TEST(HpzTest, ParityAndBackwardAllGathersWithinTheSubgroup) {
  const models::TransformerConfig config = DebugConfig("gpt2_debug", 3);
  const TrainResult ref = parity::RunReference(config, kSteps);
  CpuAllocator alloc;
  Allocator* previous = SetAllocator(&alloc);
  std::atomic<int64_t> expected_kept{0};
  int64_t kept = -1;
  FsdpRun run;
  run.axes = {{"dp", 4}};
  run.options.hpz_degree = 2;
  run.steps = kSteps;
  run.setup = [&](int, DeviceMesh& mesh, models::Transformer&,
                  const Units& units) {
    // Between forward and backward each rank keeps the root unsharded and,
    // of each block, the piece of (4 / 2) segments its pair gathers from.
    int64_t mine = UnshardedBytes(units.root, DType::kF32);
    for (FsdpUnit* block : units.blocks) {
      EXPECT_EQ(block->hpz_group(), *mesh.Subgroup("dp", 2));
      EXPECT_EQ(block->hpz_group()->size(), 2);
      mine += block->segment_elements() * 2 * 4;
    }
    expected_kept += mine;
    parity::Barrier(mesh);
  };
  run.after_forward = [&](int rank, int step, DeviceMesh& mesh) {
    if (step != 0) return;  // Before any reduce-scatter scratch exists.
    parity::Barrier(mesh);
    if (rank == 0) kept = alloc.Stats().current_of(MemoryTag::kCommBuffers);
    parity::Barrier(mesh);
  };
  run.finish = [&](int, DeviceMesh&, const Units& units) {
    for (FsdpUnit* block : units.blocks) {
      EXPECT_EQ(block->stats().forward_all_gathers,
                (std::map<int, int64_t>{{4, kSteps}}));
      EXPECT_EQ(block->stats().backward_all_gathers,
                (std::map<int, int64_t>{{2, kSteps}}));
      EXPECT_EQ(block->stats().reduce_scatters, kSteps);
    }
    // The root keeps its parameters unsharded from forward to backward.
    EXPECT_EQ(units.root->stats().forward_all_gathers,
              (std::map<int, int64_t>{{4, kSteps}}));
    EXPECT_TRUE(units.root->stats().backward_all_gathers.empty());
  };
  const TrainResult got = parity::RunFsdp(config, run);
  SetAllocator(previous);
  parity::ExpectParity(ref, got, 1e-4, 1e-5, "gpt2 W=4 hpZ N=2");
  EXPECT_EQ(kept, expected_kept.load());
}

TEST(HpzTest, ChangesNoNumbers) {
  // bf16 all-gathers: the kept piece is a copy of the gathered bf16 values,
  // so hpZ (N=2, and N=4 = the whole axis) is bitwise plain ZeRO-3.
  const models::TransformerConfig config = DebugConfig("llama_debug");
  FsdpRun run;
  run.axes = {{"dp", 4}};
  run.options.mp_policy.param_dtype = DType::kBF16;
  run.steps = 2;
  const TrainResult plain = parity::RunFsdp(config, run);
  for (int n : {2, 4}) {
    run.options.hpz_degree = n;
    run.finish = [n](int, DeviceMesh&, const Units& units) {
      for (FsdpUnit* block : units.blocks) {
        EXPECT_EQ(block->stats().backward_all_gathers,
                  (std::map<int, int64_t>{{n, 2}}));
      }
    };
    parity::ExpectIdentical(plain, parity::RunFsdp(config, run),
                            absl::StrCat("llama bf16 hpZ N=", n));
  }
}

TEST(HpzTest, HsdpSubgroupsStayWithinTheReplica) {
  // {replicate: 2, shard: 2} with N=2 is the whole shard axis; {replicate:
  // 1, shard: 4} with N=2 exercises a 2-D mesh's subgroup naming.
  const models::TransformerConfig config = DebugConfig("gpt2_debug");
  const TrainResult ref = parity::RunReference(config, kSteps);
  FsdpRun run;
  run.axes = {{"replicate", 1}, {"shard", 4}};
  run.options.hpz_degree = 2;
  run.finish = [](int, DeviceMesh& mesh, const Units& units) {
    EXPECT_EQ(units.blocks[0]->hpz_group(), *mesh.Subgroup("shard", 2));
    EXPECT_EQ(units.blocks[0]->stats().backward_all_gathers,
              (std::map<int, int64_t>{{2, kSteps}}));
  };
  parity::ExpectParity(ref, parity::RunFsdp(config, run), 1e-4, 1e-5,
                       "gpt2 1x4 hpZ N=2");
  run.axes = {{"replicate", 2}, {"shard", 2}};
  parity::ExpectParity(ref, parity::RunFsdp(config, run), 1e-4, 1e-5,
                       "gpt2 HSDP 2x2 hpZ N=2");
}

TEST(HpzTest, WithActivationCheckpointing) {
  // The recomputing forward in backward unshards from the kept piece.
  const models::TransformerConfig config = DebugConfig("gpt2_debug");
  const TrainResult ref = parity::RunReference(config, kSteps);
  FsdpRun run;
  run.axes = {{"dp", 4}};
  run.options.hpz_degree = 2;
  run.setup = [](int, DeviceMesh&, models::Transformer& model, const Units&) {
    model.set_activation_checkpointing(nn::CheckpointPolicy::Full());
  };
  run.finish = [](int, DeviceMesh&, const Units& units) {
    for (FsdpUnit* block : units.blocks) {
      EXPECT_EQ(block->stats().backward_all_gathers,
                (std::map<int, int64_t>{{2, kSteps}}));
    }
  };
  parity::ExpectParity(ref, parity::RunFsdp(config, run), 1e-4, 1e-5,
                       "gpt2 W=4 hpZ N=2 activation checkpointing");
}

TEST(HpzTest, LastBlockKeptUnshardedIgnoresIt) {
  // A plan keeping its last block unsharded after forward passes the same
  // hpz_degree to every unit: that block just never regathers.
  const models::TransformerConfig config = DebugConfig("gpt2_debug", 3);
  const TrainResult ref = parity::RunReference(config, kSteps);
  FsdpRun run;
  run.axes = {{"dp", 4}};
  run.options.hpz_degree = 2;
  run.block_options = [](size_t index, FullyShardOptions* options) {
    if (index == 2) options->reshard_after_forward = false;
  };
  run.finish = [](int, DeviceMesh&, const Units& units) {
    EXPECT_EQ(units.blocks[0]->stats().backward_all_gathers,
              (std::map<int, int64_t>{{2, kSteps}}));
    EXPECT_EQ(units.blocks[1]->stats().backward_all_gathers,
              (std::map<int, int64_t>{{2, kSteps}}));
    EXPECT_EQ(units.blocks[2]->hpz_group(), nullptr);
    EXPECT_TRUE(units.blocks[2]->stats().backward_all_gathers.empty());
  };
  parity::ExpectParity(ref, parity::RunFsdp(config, run), 1e-4, 1e-5,
                       "gpt2 W=4 hpZ N=2, last block kept");
}

TEST(HpzTest, BadDegreesAreErrors) {
  ::fsdpp::testing_util::RunOnMesh({{"dp", 4}}, [](int, DeviceMesh& mesh) {
    auto model = *models::Transformer::Create(DebugConfig("gpt2_debug"));
    FullyShardOptions options;
    options.mesh = &mesh;
    options.hpz_degree = 3;
    absl::StatusOr<FsdpUnit*> unit = FullyShard({model->blocks()[0]}, options);
    ASSERT_FALSE(unit.ok());
    EXPECT_EQ(unit.status().message(),
              "FullyShard: hpz_degree 3 does not divide the size 4 of shard "
              "axis 'dp'");
    options.hpz_degree = -1;
    unit = FullyShard({model->blocks()[0]}, options);
    ASSERT_FALSE(unit.ok());
    EXPECT_EQ(unit.status().message(),
              "FullyShard: hpz_degree must be >= 0, got -1");
    // Degree 1 is off; so is any degree for a unit that keeps its parameters
    // unsharded after forward (e.g. a plan's last block).
    options.hpz_degree = 1;
    unit = FullyShard({model->blocks()[0]}, options);
    ASSERT_TRUE(unit.ok()) << unit.status();
    EXPECT_EQ((*unit)->hpz_group(), nullptr);
    options.hpz_degree = 2;
    options.reshard_after_forward = false;
    unit = FullyShard({model->blocks()[1]}, options);
    ASSERT_TRUE(unit.ok()) << unit.status();
    EXPECT_EQ((*unit)->hpz_group(), nullptr);
  });
}

}  // namespace
}  // namespace fsdp
}  // namespace fsdpp
