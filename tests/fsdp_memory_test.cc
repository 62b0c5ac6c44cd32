// Memory guarantees and explicit prefetching of fully_shard, measured through
// the allocator's exact accounting (a fresh CpuAllocator per run).
//
// The allocator is process-wide and thread ranks share it, so per-rank
// bounds are checked on 1-rank meshes, where everything is deterministic,
// and on 2-rank meshes as sums (the peak of a sum is at most the sum of the
// per-rank bounds; currents read between barriers are exact sums). The
// one-rank runs compute in bf16: on one rank in f32 nothing is gathered or
// reduce-scattered (checked: no comm buffer at all).
//
//   * ZeRO-3 comm-buffer peak (all-gather outputs, unsharded parameters,
//     reduce-scatter buffers) <= the root's unsharded parameters + the
//     largest block's unsharded parameters + the largest all-gather output
//     (the running unit's during its copy-out, or the one prefetched unit's)
//     + the largest reduce-scatter's buffers (one in flight) + Gloo's
//     reduce-scatter scratch; a 6-block model, so keeping reduce-scatter
//     buffers of every block until the end of backward would break it.
//   * ZeRO-3 peaks < ZeRO-2 peaks (comm buffers and total).
//   * After step 3 and after step 20 every tag holds the same bytes (AdamW
//     state included), comm buffers hold only Gloo's scratch, and from the
//     second step on every step has the same peaks.
//   * SetModulesToForwardPrefetch / SetModulesToBackwardPrefetch decide which
//     unit's all-gather is in flight when a block starts forward / backward
//     (probed from hooks), keep parity, and prefetching every unit at once
//     raises the comm-buffer peak.
#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/allocator.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "optim/adamw.h"
#include "tests/fsdp_testing.h"

namespace fsdpp {
namespace fsdp {
namespace {

using parity::DebugConfig;
using parity::FsdpRun;
using parity::TrainResult;
using parity::Units;

constexpr int64_t kF32 = 4;
// One-rank runs compute in bf16 (f32 masters, f32 reduction): in f32 their
// parameters would be views of the masters, with nothing gathered.
DType ParamDtype(int world) { return world == 1 ? DType::kBF16 : DType::kF32; }

// Bytes of one element of `unit`'s unsharded parameters (its param dtype).
int64_t ParamBytes(FsdpUnit* unit) {
  return DTypeSize(unit->parameters().front().parameter->dtype);
}

int64_t UnshardedBytes(FsdpUnit* unit) {
  int64_t n = 0;
  for (ShardedParameter& sp : unit->parameters()) n += NumElements(sp.shape);
  return n * ParamBytes(unit);
}

std::vector<FsdpUnit*> AllUnits(const Units& units) {
  std::vector<FsdpUnit*> all = units.blocks;
  all.push_back(units.root);
  return all;
}

// Bytes of Gloo's reduce-scatter scratch on one rank: 3 chunks of the
// largest reduce-scatter (chunk = one segment), kept by the comm thread.
int64_t GlooScratchBytes(const Units& units, int world) {
  if (world == 1) return 0;
  int64_t segment = 0;
  for (FsdpUnit* u : AllUnits(units))
    segment = std::max(segment, u->segment_elements());
  return 3 * segment * kF32;
}

// The ZeRO-3 comm-buffer bound of one rank (reduction in f32), see the file
// comment and fully_shard.h.
int64_t CommBound(const Units& units, int world) {
  int64_t block = 0, gathered = 0, reduce = 0;
  for (FsdpUnit* b : units.blocks) block = std::max(block, UnshardedBytes(b));
  for (FsdpUnit* u : AllUnits(units)) {
    gathered =
        std::max(gathered, world * u->segment_elements() * ParamBytes(u));
    reduce = std::max(reduce, (world + 1) * u->segment_elements() * kF32);
  }
  return UnshardedBytes(units.root) + block + gathered + reduce +
         GlooScratchBytes(units, world);
}

// Peaks of one training run from after setup to the end.
struct Peaks {
  int64_t comm = 0, total = 0;
  int64_t bound = 0;      // CommBound summed over ranks
  int64_t at_least = 0;   // root + largest block unsharded, summed
  int64_t all_units = 0;  // every unit unsharded, summed
};

Peaks MeasurePeaks(const models::TransformerConfig& config, int world,
                   bool zero3, DType param_dtype) {
  CpuAllocator alloc;
  Allocator* previous = SetAllocator(&alloc);
  std::atomic<int64_t> bound{0}, at_least{0}, all_units{0};
  FsdpRun run;
  run.axes = {{"dp", world}};
  run.options.reshard_after_forward = zero3;
  run.options.mp_policy.param_dtype = param_dtype;
  run.collect = false;  // Gathering results would allocate comm buffers.
  run.setup = [&](int rank, DeviceMesh& mesh, models::Transformer&,
                  const Units& units) {
    bound += CommBound(units, world);
    int64_t block = 0, all = 0;
    for (FsdpUnit* u : AllUnits(units)) all += UnshardedBytes(u);
    for (FsdpUnit* b : units.blocks) block = std::max(block, UnshardedBytes(b));
    at_least += UnshardedBytes(units.root) + block;
    all_units += all;
    parity::Barrier(mesh);
    if (rank == 0) alloc.ResetPeak();
    parity::Barrier(mesh);
  };
  parity::RunFsdp(config, run);
  SetAllocator(previous);
  Peaks peaks;
  peaks.comm = alloc.Stats().peak_of(MemoryTag::kCommBuffers);
  peaks.total = alloc.Stats().total_peak;
  peaks.bound = bound;
  peaks.at_least = at_least;
  peaks.all_units = all_units;
  return peaks;
}

TEST(FsdpMemoryTest, Zero3CommPeakIsBoundedByTheRunningAndPrefetched) {
  const models::TransformerConfig config = DebugConfig("gpt2_debug", 6);
  for (int world : {1, 2}) {
    const Peaks p =
        MeasurePeaks(config, world, /*zero3=*/true, ParamDtype(world));
    EXPECT_LE(p.comm, p.bound) << "W=" << world;
    EXPECT_GE(p.comm, p.at_least) << "W=" << world;
    // Far below "everything unsharded".
    EXPECT_LT(p.comm, p.all_units) << "W=" << world;
  }
  // One rank computing in f32: the parameters are views of the masters and
  // the gradients go straight into their shards, so nothing is allocated.
  EXPECT_EQ(MeasurePeaks(config, 1, /*zero3=*/true, DType::kF32).comm, 0);
}

TEST(FsdpMemoryTest, Zero3PeaksAreBelowZero2Peaks) {
  const models::TransformerConfig config = DebugConfig("gpt2_debug", 6);
  const Peaks zero3 = MeasurePeaks(config, 1, /*zero3=*/true, ParamDtype(1));
  const Peaks zero2 = MeasurePeaks(config, 1, /*zero3=*/false, ParamDtype(1));
  EXPECT_LT(zero3.comm, zero2.comm);
  EXPECT_LT(zero3.total, zero2.total);
  // ZeRO-2 holds every unit unsharded at the end of forward.
  EXPECT_GE(zero2.comm, zero2.all_units);
}

TEST(FsdpMemoryTest, NoGrowthAcrossSteps) {
  const models::TransformerConfig config = DebugConfig("gpt2_debug", 3);
  for (int world : {1, 2}) {
    CpuAllocator alloc;
    Allocator* previous = SetAllocator(&alloc);
    std::vector<std::optional<AdamW>> optimizers(world);
    std::map<int, MemoryStats> after;  // by step
    std::vector<int64_t> comm_peaks, total_peaks;
    std::atomic<int64_t> scratch{0};
    FsdpRun run;
    run.axes = {{"dp", world}};
    run.steps = 20;
    run.collect = false;
    run.setup = [&](int, DeviceMesh&, models::Transformer&,
                    const Units& units) {
      scratch += GlooScratchBytes(units, world);
    };
    run.update = [&](int rank, const std::vector<ShardedParameter*>& params) {
      if (!optimizers[rank].has_value()) {
        std::vector<AdamWParam> list;
        for (ShardedParameter* sp : params)
          list.emplace_back(sp->name, &sp->master, &sp->grad);
        optimizers[rank].emplace(*AdamW::Create(std::move(list)));
      }
      ASSERT_TRUE(optimizers[rank]->Step().ok());
    };
    run.after_step = [&](int rank, int step, DeviceMesh& mesh) {
      parity::Barrier(mesh);
      if (rank == 0) {
        const MemoryStats s = alloc.Stats();
        after[step + 1] = s;
        comm_peaks.push_back(s.peak_of(MemoryTag::kCommBuffers));
        total_peaks.push_back(s.total_peak);
        alloc.ResetPeak();
      }
      parity::Barrier(mesh);
    };
    run.finish = [&](int rank, DeviceMesh&, const Units&) {
      optimizers[rank].reset();
    };
    parity::RunFsdp(config, run);
    SetAllocator(previous);
    const MemoryStats& s3 = after.at(3);
    const MemoryStats& s20 = after.at(20);
    for (int t = 0; t < kNumMemoryTags; ++t) {
      EXPECT_EQ(s3.current[t], s20.current[t])
          << "W=" << world << " tag "
          << MemoryTagName(static_cast<MemoryTag>(t));
    }
    EXPECT_EQ(s3.total_current, s20.total_current) << "W=" << world;
    EXPECT_EQ(s3.num_allocations, s20.num_allocations) << "W=" << world;
    EXPECT_GT(s20.current_of(MemoryTag::kOptimizerState), 0);
    // Between steps FSDP holds no comm buffer at all.
    EXPECT_EQ(s20.current_of(MemoryTag::kCommBuffers), scratch.load())
        << "W=" << world;
    if (world == 1) {
      // Deterministic on one rank: every step after the first (which has no
      // recorded order to prefetch by and allocates the AdamW state) peaks
      // the same.
      for (size_t i = 2; i < comm_peaks.size(); ++i) {
        EXPECT_EQ(comm_peaks[i], comm_peaks[1]) << "step " << i + 1;
        EXPECT_EQ(total_peaks[i], total_peaks[1]) << "step " << i + 1;
      }
    }
  }
}

// Which units' all-gathers are in flight, as "b0,b2" / "root".
std::string InFlight(const Units& units) {
  std::vector<std::string> names;
  for (size_t i = 0; i < units.blocks.size(); ++i) {
    if (units.blocks[i]->all_gather_in_flight())
      names.push_back(absl::StrCat("b", i));
  }
  if (units.root->all_gather_in_flight()) names.push_back("root");
  return absl::StrJoin(names, ",");
}

// How a prefetch test sets up its units.
using PrefetchPlan = std::function<void(const Units& units)>;

struct PrefetchRun {
  TrainResult result;
  std::vector<std::string> probes;  // rank 0: "F1:b2" = at block 1's forward
  std::vector<int64_t> prefetched;  // rank 0: per block, at the end
};

PrefetchRun RunPrefetch(const models::TransformerConfig& config, int world,
                        const PrefetchPlan& plan, int steps) {
  PrefetchRun out;
  FsdpRun run;
  run.axes = {{"dp", world}};
  run.steps = steps;
  run.setup = [&](int rank, DeviceMesh&, models::Transformer& model,
                  const Units& units) {
    plan(units);
    if (rank != 0) return;
    for (size_t i = 0; i < units.blocks.size(); ++i) {
      // Added after FullyShard's hooks: they see the state FSDP left.
      model.blocks()[i]->AddPreForwardHook([&out, units, i](Module&) {
        out.probes.push_back(absl::StrCat("F", i, ":", InFlight(units)));
        return absl::OkStatus();
      });
      model.blocks()[i]->AddPreBackwardHook([&out, units, i](Module&) {
        out.probes.push_back(absl::StrCat("B", i, ":", InFlight(units)));
        return absl::OkStatus();
      });
    }
  };
  run.finish = [&](int rank, DeviceMesh&, const Units& units) {
    if (rank != 0) return;
    for (FsdpUnit* b : units.blocks)
      out.prefetched.push_back(b->stats().prefetched_all_gathers);
  };
  out.result = parity::RunFsdp(config, run);
  return out;
}

TEST(FsdpMemoryTest, ExplicitPrefetchDecidesWhatIsInFlight) {
  const models::TransformerConfig config = DebugConfig("gpt2_debug", 3);
  constexpr int kSteps = 2;
  const TrainResult ref = parity::RunReference(config, kSteps);

  // Recorded order: forward prefetches the next block from the second step
  // on (the first records the order); backward prefetches the previous one.
  const PrefetchRun implicit = RunPrefetch(
      config, 2, [](const Units&) {}, kSteps);
  parity::ExpectParity(ref, implicit.result, 1e-4, 1e-5, "implicit");
  EXPECT_EQ(implicit.probes,
            (std::vector<std::string>{"F0:", "F1:", "F2:", "B2:b1", "B1:b0",
                                      "B0:", "F0:b1", "F1:b2", "F2:", "B2:b1",
                                      "B1:b0", "B0:"}));
  EXPECT_EQ(implicit.prefetched, (std::vector<int64_t>{3, 3, 1}));

  // Block 0 skips block 1 and prefetches block 2; block 1 prefetches nothing
  // in either direction; block 2's backward prefetches block 0.
  const PrefetchRun explicit_plan = RunPrefetch(
      config, 2,
      [](const Units& u) {
        u.blocks[0]->SetModulesToForwardPrefetch({u.blocks[2]});
        u.blocks[1]->SetModulesToForwardPrefetch({});
        u.blocks[1]->SetModulesToBackwardPrefetch({});
        u.blocks[2]->SetModulesToBackwardPrefetch({u.blocks[0]});
      },
      kSteps);
  parity::ExpectParity(ref, explicit_plan.result, 1e-4, 1e-5, "explicit");
  EXPECT_EQ(explicit_plan.probes,
            (std::vector<std::string>{"F0:b2", "F1:b2", "F2:", "B2:b0", "B1:b0",
                                      "B0:", "F0:b2", "F1:b2", "F2:", "B2:b0",
                                      "B1:b0", "B0:"}));
  // Block 0: by the root in the second forward, by block 2 in each
  // backward; block 1: never; block 2: by block 0 in each forward.
  EXPECT_EQ(explicit_plan.prefetched, (std::vector<int64_t>{3, 0, 2}));
}

TEST(FsdpMemoryTest, PrefetchingEverythingRaisesTheCommPeak) {
  const models::TransformerConfig config = DebugConfig("gpt2_debug", 3);
  auto comm_peak = [&](const PrefetchPlan& plan) {
    CpuAllocator alloc;
    Allocator* previous = SetAllocator(&alloc);
    FsdpRun run;
    run.axes = {{"dp", 1}};
    run.steps = 2;
    run.collect = false;
    run.options.mp_policy.param_dtype = ParamDtype(1);
    run.setup = [&](int, DeviceMesh&, models::Transformer&,
                    const Units& units) {
      plan(units);
      alloc.ResetPeak();
    };
    parity::RunFsdp(config, run);
    SetAllocator(previous);
    return alloc.Stats().peak_of(MemoryTag::kCommBuffers);
  };
  const int64_t implicit = comm_peak([](const Units&) {});
  const int64_t none = comm_peak([](const Units& u) {
    for (FsdpUnit* unit : AllUnits(u)) {
      unit->SetModulesToForwardPrefetch({});
      unit->SetModulesToBackwardPrefetch({});
    }
  });
  int64_t root_and_three_gathers = 0;
  const int64_t all_at_once = comm_peak([&](const Units& u) {
    u.root->SetModulesToForwardPrefetch(u.blocks);
    u.blocks.back()->SetModulesToBackwardPrefetch(
        std::vector<FsdpUnit*>(u.blocks.rbegin() + 1, u.blocks.rend()));
    root_and_three_gathers = UnshardedBytes(u.root);
    for (FsdpUnit* b : u.blocks)
      root_and_three_gathers += b->segment_elements() * ParamBytes(b);
  });
  EXPECT_LE(none, implicit);
  EXPECT_GT(all_at_once, implicit);
  // The root unsharded and all three blocks' all-gathers in flight at once.
  EXPECT_GE(all_at_once, root_and_three_gathers);
}

}  // namespace
}  // namespace fsdp
}  // namespace fsdpp
