// OffloadPolicy on thread ranks over real Gloo. On this CPU-only build the
// compute device is the host, so offloading moves nothing: these tests run
// the offload branch end to end (host staging of the all-gather input with
// the cast on the host, one host-to-"device" copy into the all-gather slot,
// one "device"-to-host copy of the reduced shard, accumulation on the host)
// and check that it trains exactly like the reference (ZeRO-2, ZeRO-3, hpZ),
// bitwise like the non-offloaded run (bf16, AdamW), and that the masters,
// gradients and the AdamW state it drives all live on the host.
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
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

constexpr int kSteps = 3;

// Every unit offloads, and its state is on the host.
void ExpectOffloaded(const Units& units) {
  std::vector<FsdpUnit*> all = units.blocks;
  all.push_back(units.root);
  for (FsdpUnit* unit : all) {
    EXPECT_TRUE(unit->offload_params());
    EXPECT_EQ(unit->compute_device(), Device::Cpu());
    for (ShardedParameter& sp : unit->parameters()) {
      EXPECT_EQ(sp.master.local().device(), Device::Cpu()) << sp.name;
      EXPECT_EQ(sp.grad.local().device(), Device::Cpu()) << sp.name;
    }
  }
}

TEST(OffloadTest, ParityWithTheReference) {
  const models::TransformerConfig config = DebugConfig("gpt2_debug");
  const TrainResult ref = parity::RunReference(config, kSteps);
  struct Case {
    int world;
    bool zero3;
    int hpz;
  };
  for (const Case& c : {Case{1, true, 0}, Case{2, true, 0}, Case{2, false, 0},
                        Case{4, true, 2}}) {
    FsdpRun run;
    run.axes = {{"dp", c.world}};
    run.options.reshard_after_forward = c.zero3;
    run.options.hpz_degree = c.hpz;
    run.options.offload_policy.offload_params = true;
    run.steps = kSteps;
    run.setup = [](int, DeviceMesh&, models::Transformer&, const Units& u) {
      ExpectOffloaded(u);
    };
    parity::ExpectParity(
        ref, parity::RunFsdp(config, run), 1e-4, 1e-5,
        absl::StrCat("gpt2 offload W=", c.world,
                     c.zero3 ? " ZeRO-3" : " ZeRO-2", c.hpz > 1 ? " hpZ" : ""));
  }
}

TEST(OffloadTest, Bf16IsBitwiseTheNonOffloadedRun) {
  // The cast to bf16 happens on the host staging segment instead of in the
  // all-gather slot: the same conversion, so the same bits.
  const models::TransformerConfig config = DebugConfig("llama_debug");
  FsdpRun run;
  run.axes = {{"dp", 2}};
  run.options.mp_policy.param_dtype = DType::kBF16;
  run.options.mp_policy.reduce_dtype = DType::kBF16;
  run.steps = 2;
  const TrainResult plain = parity::RunFsdp(config, run);
  run.options.offload_policy.offload_params = true;
  parity::ExpectIdentical(plain, parity::RunFsdp(config, run),
                          "llama bf16 offload");
}

TEST(OffloadTest, AdamWStateFollowsTheOffloadedMasters) {
  // AdamW allocates its state beside each parameter and runs where the
  // parameter lives: with offloaded masters, on the host.
  const models::TransformerConfig config = DebugConfig("gpt2_debug");
  constexpr int kWorld = 2;
  auto run_with_adamw = [&](bool offload) {
    std::vector<std::optional<AdamW>> optimizers(kWorld);
    FsdpRun run;
    run.axes = {{"dp", kWorld}};
    run.options.offload_policy.offload_params = offload;
    run.steps = kSteps;
    run.update = [&](int rank, const std::vector<ShardedParameter*>& params) {
      if (!optimizers[rank].has_value()) {
        std::vector<AdamWParam> list;
        for (ShardedParameter* sp : params)
          list.emplace_back(sp->name, &sp->master, &sp->grad);
        AdamWOptions o;
        o.lr = 1e-2;
        absl::StatusOr<AdamW> opt = AdamW::Create(std::move(list), o);
        ASSERT_TRUE(opt.ok()) << opt.status();
        optimizers[rank].emplace(std::move(*opt));
      }
      absl::Status s = optimizers[rank]->Step();
      ASSERT_TRUE(s.ok()) << s;
    };
    run.finish = [&](int rank, DeviceMesh&, const Units& units) {
      if (offload) ExpectOffloaded(units);
      absl::StatusOr<OptimizerStateDict> state = optimizers[rank]->StateDict();
      ASSERT_TRUE(state.ok()) << state.status();
      EXPECT_FALSE(state->tensors.empty());
      for (auto& [name, t] : state->tensors)
        EXPECT_EQ(t.local().device(), Device::Cpu()) << name;
      optimizers[rank].reset();
    };
    return parity::RunFsdp(config, run);
  };
  parity::ExpectIdentical(run_with_adamw(false), run_with_adamw(true),
                          "gpt2 AdamW offload");
}

}  // namespace
}  // namespace fsdp
}  // namespace fsdpp
